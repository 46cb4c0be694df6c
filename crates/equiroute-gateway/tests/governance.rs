//! Audit log, capability eligibility and the admin key.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, start};
use serde_json::json;
use std::time::{Duration, Instant};

const BASE: &str = r#"
[interfaces.chat]
kind = "chat"
policy = { name = "lqm-ts" }
deadline_ms = 3000

[[interfaces.chat.providers]]
id = "no-tools"
kind = "sim"
capabilities = { tools = false }
sim = { latency = { p50_ms = 2, p95_ms = 4 } }

[[interfaces.chat.providers]]
id = "full"
kind = "sim"
sim = { latency = { p50_ms = 2, p95_ms = 4 } }
"#;

fn chat(extra: &serde_json::Value) -> String {
    let mut body = json!({"model": "chat", "messages": [{"role": "user", "content": "hello"}]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body.to_string()
}

#[tokio::test]
async fn every_decision_is_audited_and_the_log_rotates() {
    let dir = std::env::temp_dir().join(format!("equiroute-audit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("audit.jsonl");
    let config = format!(
        "[audit]\npath = {:?}\nmax_bytes = 3000\nkeep = 10\n{BASE}",
        path.display().to_string()
    );
    let gw = start(&config, &[]).await;
    for _ in 0..12 {
        assert_eq!(
            http(
                gw.addr,
                "POST",
                "/v1/chat/completions",
                &[],
                &chat(&json!({}))
            )
            .await
            .status,
            200
        );
    }
    // The writer runs in the background: wait (bounded) until all twelve lines are on disk.
    let read_all = || {
        let mut lines = Vec::new();
        let rotated = (1..=10).rev().map(|k| dir.join(format!("audit.jsonl.{k}")));
        for p in rotated.chain([path.clone()]) {
            if let Ok(text) = std::fs::read_to_string(&p) {
                lines.extend(text.lines().map(str::to_owned));
            }
        }
        lines
    };
    let until = Instant::now() + Duration::from_secs(5);
    while read_all().len() < 12 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lines = read_all();
    assert_eq!(
        lines.len(),
        12,
        "one line per request, none lost across rotations"
    );
    assert!(
        dir.join("audit.jsonl.1").exists(),
        "rotated past 3000 bytes"
    );
    assert!(std::fs::metadata(&path).unwrap().len() <= 3000);
    for line in &lines {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(r["interface"], "chat");
        assert_eq!(r["policy"], "lqm-ts");
        assert_eq!(r["candidates"].as_array().unwrap().len(), 2);
        assert_eq!(r["order"].as_array().unwrap().len(), 2);
        assert!(r["scores"][0]["breakdown"].is_object());
        assert_eq!(r["outcome"], "ok");
        assert_eq!(r["attempts"].as_array().unwrap().len(), 1);
        assert!(r["request_id"].as_str().unwrap().starts_with("req-"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn requests_that_need_tools_skip_providers_without_them() {
    let gw = start(BASE, &[]).await;
    let tools =
        json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]});
    for _ in 0..5 {
        let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat(&tools)).await;
        assert_eq!(
            (r.status, r.header("x-equiroute-provider")),
            (200, Some("full"))
        );
    }
    let mut pinned = tools.clone();
    pinned["model"] = json!("chat/no-tools");
    let r = http(gw.addr, "POST", "/v1/chat/completions", &[], &chat(&pinned)).await;
    // The request's own: a 400 naming the member, not a 503 that SDKs retry.
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "tools", "{}", r.body);
    assert!(
        r.body.contains("no-tools: does not support tools"),
        "{}",
        r.body
    );
}

#[tokio::test]
async fn state_routes_take_the_admin_key() {
    let config =
        format!("[server]\napi_keys_env = [\"GW_K\"]\nadmin_keys_env = [\"GW_ADMIN\"]\n{BASE}");
    let gw = start(&config, &[("GW_K", "user-key"), ("GW_ADMIN", "admin-key")]).await;
    let user = [("authorization", "Bearer user-key")];
    let admin = [("authorization", "Bearer admin-key")];
    assert_eq!(
        http(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &user,
            &chat(&json!({}))
        )
        .await
        .status,
        200
    );
    assert_eq!(
        http(gw.addr, "GET", "/v1/interfaces", &user, "")
            .await
            .status,
        401
    );
    assert_eq!(
        http(gw.addr, "GET", "/v1/interfaces", &admin, "")
            .await
            .status,
        200
    );
    assert_eq!(
        http(gw.addr, "GET", "/v1/interfaces/chat/state", &admin, "")
            .await
            .status,
        200
    );
    assert_eq!(
        http(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &admin,
            &chat(&json!({}))
        )
        .await
        .status,
        401
    );
}

/// Waits (bounded) until `/metrics` contains `needle`.
async fn metrics_show(addr: std::net::SocketAddr, needle: &str) -> String {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let m = http(addr, "GET", "/metrics", &[], "").await.body;
        if m.contains(needle) || Instant::now() > until {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn judged(judge: std::net::SocketAddr) -> String {
    format!(
        r#"
[interfaces.chat]
kind = "chat"
policy = {{ name = "lqm" }}
judge = {{ base_url = "http://{judge}/v1", model = "judge-1", sample_rate = 1.0 }}

[[interfaces.chat.providers]]
id = "only"
kind = "sim"
sim = {{ latency = {{ p50_ms = 2, p95_ms = 4 }} }}
"#
    )
}

#[tokio::test]
async fn an_llm_judge_scores_answers_in_the_background() {
    let judge = common::mock("[chat]\ncontent = \"Score: 0.9\"\n").await;
    let gw = start(&judged(judge.addr), &[]).await;
    let quality = |v: &serde_json::Value| {
        let estimates = &v["candidates"][0]["estimates"];
        (
            estimates["quality"].as_f64(),
            estimates["quality_observations"].as_u64(),
        )
    };
    let before = quality(
        &http(gw.addr, "GET", "/v1/interfaces/chat/state", &[], "")
            .await
            .json(),
    );
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat(&json!({})),
    )
    .await;
    assert_eq!(r.status, 200);
    let m = metrics_show(
        gw.addr,
        r#"equiroute_feedback_total{outcome="judge_accepted"} 1"#,
    )
    .await;
    assert!(
        m.contains(r#"equiroute_feedback_total{outcome="judge_accepted"} 1"#),
        "{m}"
    );
    let after = quality(
        &http(gw.addr, "GET", "/v1/interfaces/chat/state", &[], "")
            .await
            .json(),
    );
    assert_eq!(before, (None, Some(0)), "no score yet: no estimate");
    assert!(
        after.0.unwrap() > 0.01 && after.1 == Some(1),
        "judge score reached the policy: {before:?} → {after:?}"
    );
    assert_eq!(
        http(judge.addr, "GET", "/_stats", &[], "").await.json()["chat"],
        1
    );
    // The judged request's feedback slot is used: a later API score is a duplicate.
    let id = r.header("x-equiroute-request-id").unwrap();
    let fb = http(
        gw.addr,
        "POST",
        "/v1/feedback",
        &[],
        &json!({"request_id": id, "quality": 0.1}).to_string(),
    )
    .await;
    assert_eq!(fb.json()["status"], "duplicate");
}

#[tokio::test]
async fn a_failing_judge_never_fails_the_request() {
    let judge = common::mock("[chat]\nerror_500 = 1.0\n").await;
    let gw = start(&judged(judge.addr), &[]).await;
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat(&json!({})),
    )
    .await;
    assert_eq!(r.status, 200);
    let m = metrics_show(gw.addr, r#"outcome="judge_failed"} 1"#).await;
    assert!(
        m.contains(r#"equiroute_feedback_total{outcome="judge_failed"} 1"#),
        "{m}"
    );
}

#[tokio::test]
async fn tenants_are_checked_and_latency_is_measured() {
    let config = BASE.replace(
        "id = \"full\"\nkind = \"sim\"",
        "id = \"full\"\nkind = \"sim\"\ntenants = [\"acme\"]",
    );
    let gw = start(&config, &[]).await;
    let pinned = json!({"model": "chat/full"});
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-equiroute-tenant", "globex")],
        &chat(&pinned),
    )
    .await;
    assert_eq!(r.status, 403, "{}", r.body);
    assert!(
        r.body.contains("tenant `globex` is not on its allow-list"),
        "{}",
        r.body
    );
    let r = http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[
            ("x-equiroute-tenant", "acme"),
            ("x-equiroute-task-class", "rerank"),
        ],
        &chat(&pinned),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert!(
        m.contains("equiroute_request_latency_ms_count{interface=\"chat\"} 1"),
        "{m}"
    );
}
