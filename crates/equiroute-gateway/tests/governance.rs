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
    assert_eq!(r.status, 503, "{}", r.body);
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
