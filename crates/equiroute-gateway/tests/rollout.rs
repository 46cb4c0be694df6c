//! Shadow policies and canary rollouts against the mock upstream: a shadow learns without ever
//! acting (the mock's per-model call counters prove it), a canary that sends its traffic to a
//! failing provider is rolled back by the guard within a bounded number of requests, and the
//! rollout's admin routes take the admin key.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{calls, http, mock, start, Reply};
use serde_json::{json, Value};
use std::net::SocketAddr;

/// Two providers on one mock: `a` (model `m-a`) and `b` (model `m-b`); `iface_lines` go into
/// the chat interface's table, `mock_lines` into the mock's profile.
fn config(mock: SocketAddr, iface_lines: &str, server_lines: &str) -> String {
    format!(
        r#"
[server]
{server_lines}

[interfaces.chat]
kind = "chat"
max_attempts = 1
retry = {{ server_error = false }}
{iface_lines}

[[interfaces.chat.providers]]
id = "a"
kind = "openai"
model = "m-a"
base_url = "http://{mock}/v1"

[[interfaces.chat.providers]]
id = "b"
kind = "openai"
model = "m-b"
base_url = "http://{mock}/v1"
"#
    )
}

async fn chat(addr: SocketAddr, session: &str) -> Reply {
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[("x-equiroute-session-id", session)],
        &body.to_string(),
    )
    .await
}

async fn get(addr: SocketAddr, path: &str) -> Value {
    let r = http(addr, "GET", path, &[], "").await;
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    r.json()
}

fn metric(text: &str, key: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
}

#[tokio::test]
async fn a_shadow_learns_without_ever_calling_the_provider_it_would_have_chosen() {
    let upstream = mock("").await;
    // Live: always `a`. Shadow: least-latency, which puts an unmeasured provider first; it
    // learns `a`'s latency from the live attempts and from then on would choose `b`.
    let gw = start(
        &config(
            upstream.addr,
            "policy = { name = \"static\", candidate = \"a\" }\nshadow = \"least-latency\"",
            "",
        ),
        &[],
    )
    .await;
    let before = get(gw.addr, "/v1/interfaces/chat/shadow").await;
    let latency_of = |report: &Value, id: &str| {
        report["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .unwrap()["latency_ms"]
            .clone()
    };
    assert_eq!(latency_of(&before, "a"), Value::Null, "{before}");
    for i in 0..12 {
        let r = chat(gw.addr, &format!("s-{i}")).await;
        assert_eq!(r.routed(), (200, Some("a"), Some("1")), "{}", r.body);
    }
    let after = get(gw.addr, "/v1/interfaces/chat/shadow").await;
    // It learnt: `a`'s latency estimate exists now, from 12 attempts.
    assert!(latency_of(&after, "a").as_f64().unwrap() > 0.0, "{after}");
    assert_eq!(after["learnt"], 12, "{after}");
    assert_eq!(after["shadow_policy"], "least-latency");
    assert_eq!(after["live_policy"], "static");
    // It agreed on the first request only (nothing measured: `a` first by order), then
    // would have chosen `b` eleven times, and never acted: `b` got no call.
    assert_eq!(
        (after["decisions"].clone(), after["agreements"].clone()),
        (json!(12), json!(1)),
        "{after}"
    );
    assert_eq!(after["candidates"][0]["id"], "b", "{after}");
    assert_eq!(calls(upstream.addr, "m-a").await, 12);
    assert_eq!(calls(upstream.addr, "m-b").await, 0);
    // Its value against the live policy's, from the same 12 decisions: the live policy's
    // mean bad-outcome rate is 0; the live policy is deterministic (`static`), so the
    // shadow's estimate rests on the one decision they shared, and says so.
    let bad = &after["estimate"]["bad_rate"];
    assert_eq!(bad["records"], 12, "{after}");
    assert_eq!(bad["live"]["value"], 0.0, "{after}");
    let warnings = bad["shadow"]["snips"]["warnings"].to_string();
    assert!(warnings.contains("deterministic"), "{after}");
    assert_eq!(
        after["estimate"]["quality"],
        Value::Null,
        "no score yet: {after}"
    );
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert_eq!(
        metric(&m, "equiroute_shadow_decisions_total{interface=\"chat\"} "),
        Some(12.0)
    );
    assert_eq!(
        metric(&m, "equiroute_shadow_agreements_total{interface=\"chat\"} "),
        Some(1.0)
    );
}

/// The most requests the guard may take to roll back the failing canary below: with 50% of
/// the sessions on each arm, every candidate request failing and every live one answered,
/// the default guard (margin 0.05, confidence 0.95, `tuned_for = 20`) fires at the first
/// counts with `1 − r(n_candidate) − r(n_live) > 0.05`, `r` the radius of
/// `equiroute_core::sequential` at α/4 (about 16 requests on each arm; these sessions split
/// 10 to 21, and it fires after 31 requests); 120 leaves room for any split.
const ROLLBACK_BOUND: usize = 120;

#[tokio::test]
async fn a_canary_on_a_failing_provider_is_rolled_back_within_a_bounded_number_of_requests() {
    let upstream = mock("[models.\"m-a\"]\nfault = \"unavailable\"\n").await;
    // The breaker stays closed for 64 failures in a row, so that only the guard protects.
    let gw = start(
        &config(
            upstream.addr,
            "policy = { name = \"static\", candidate = \"b\" }\n\
             breaker = { consecutive_failures = 1000, window = 64, min_attempts = 64, failure_rate = 1.0 }\n\
             rollout = { policy = { name = \"static\", candidate = \"a\" }, percent = 50, guard = { tuned_for = 20 } }",
            "",
        ),
        &[],
    )
    .await;
    let state = get(gw.addr, "/v1/interfaces/chat/rollout").await;
    assert_eq!(state["status"]["state"], "running", "{state}");
    let mut rolled_back_after = None;
    for i in 0..ROLLBACK_BOUND {
        let r = chat(gw.addr, &format!("session-{i}")).await;
        // One session, one arm: the candidate's requests fail (one attempt), the live ones
        // are answered by `b`.
        assert!(
            r.status == 502 || r.routed() == (200, Some("b"), Some("1")),
            "{}",
            r.body
        );
        let state = get(gw.addr, "/v1/interfaces/chat/rollout").await;
        if state["status"]["state"] == "rolled_back" {
            rolled_back_after = Some(i + 1);
            assert_eq!(state["status"]["metric"], "bad_rate", "{state}");
            let low = state["status"]["evidence"]["interval"][0].as_f64().unwrap();
            assert!(low > 0.05, "the evidence clears the margin: {state}");
            break;
        }
    }
    let n = rolled_back_after.expect("rolled back within the bound");
    let failed = calls(upstream.addr, "m-a").await;
    eprintln!("rolled back after {n} requests, {failed} of them on the canary");
    assert!(failed >= 10 && (failed as usize) < n, "{failed} of {n}");
    // Afterwards every session, the canary's included, goes to the live policy.
    for i in 0..20 {
        let r = chat(gw.addr, &format!("session-{i}")).await;
        assert_eq!(r.routed(), (200, Some("b"), Some("1")), "{}", r.body);
    }
    assert_eq!(calls(upstream.addr, "m-a").await, failed);
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    let event = |e: &str| {
        metric(
            &m,
            &format!("equiroute_rollout_events_total{{interface=\"chat\",event=\"{e}\"}} "),
        )
    };
    assert_eq!(event("rollback_bad_rate"), Some(1.0), "{m}");
    assert_eq!(event("promote"), Some(0.0));
    assert_eq!(
        metric(&m, "equiroute_rollout_active{interface=\"chat\"} "),
        Some(0.0)
    );
    assert_eq!(
        metric(
            &m,
            "equiroute_rollout_bad_outcomes_total{interface=\"chat\",arm=\"candidate\"} "
        ),
        Some(failed as f64)
    );
    // A rolled-back canary cannot be promoted.
    let r = http(
        gw.addr,
        "POST",
        "/v1/interfaces/chat/rollout/promote",
        &[],
        "",
    )
    .await;
    assert_eq!(r.status, 409, "{}", r.body);
}

#[tokio::test]
async fn the_rollout_routes_need_the_admin_key_and_promotion_swaps_the_live_policy() {
    let upstream = mock("").await;
    let gw = start(
        &config(
            upstream.addr,
            "policy = { name = \"static\", candidate = \"a\" }\n\
             shadow = \"round-robin\"\n\
             rollout = { policy = { name = \"static\", candidate = \"b\" }, percent = 5 }",
            "api_keys_env = [\"GW_KEY\"]\nadmin_keys_env = [\"ADMIN_KEY\"]",
        ),
        &[("GW_KEY", "gw-secret"), ("ADMIN_KEY", "admin-secret")],
    )
    .await;
    let admin = [("authorization", "Bearer admin-secret")];
    let gateway = [("authorization", "Bearer gw-secret")];
    for (method, path) in [
        ("GET", "/v1/interfaces/chat/shadow"),
        ("GET", "/v1/interfaces/chat/rollout"),
        ("POST", "/v1/interfaces/chat/rollout/promote"),
        ("POST", "/v1/interfaces/chat/rollout/abort"),
    ] {
        for headers in [
            &[][..],
            &gateway[..],
            &[("authorization", "Bearer wrong")][..],
        ] {
            let r = http(gw.addr, method, path, headers, "").await;
            assert_eq!(r.status, 401, "{method} {path} {headers:?}: {}", r.body);
            assert!(r.body.contains("admin_keys_env"), "{}", r.body);
        }
    }
    let r = http(gw.addr, "GET", "/v1/interfaces/chat/rollout", &admin, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["status"]["state"], "running");
    assert_eq!(r.json()["session_header"], "x-equiroute-session-id");
    let r = http(
        gw.addr,
        "POST",
        "/v1/interfaces/chat/rollout/promote",
        &admin,
        "",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["note"]
        .as_str()
        .unwrap()
        .contains("the state file keeps the promotion across restarts"));
    // The candidate (`static` on `b`) is live now, for every session.
    for i in 0..5 {
        let body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
        let r = http(
            gw.addr,
            "POST",
            "/v1/chat/completions",
            &[gateway[0], ("x-equiroute-session-id", &format!("s{i}"))],
            &body.to_string(),
        )
        .await;
        assert_eq!(r.routed(), (200, Some("b"), Some("1")), "{}", r.body);
    }
    let state = http(gw.addr, "GET", "/v1/interfaces/chat/rollout", &admin, "")
        .await
        .json();
    assert_eq!(state["status"]["state"], "promoted", "{state}");
    let r = http(
        gw.addr,
        "POST",
        "/v1/interfaces/chat/rollout/abort",
        &admin,
        "",
    )
    .await;
    assert_eq!(
        r.status, 409,
        "only a running rollout can be ended: {}",
        r.body
    );
    let m = http(gw.addr, "GET", "/metrics", &[], "").await.body;
    assert_eq!(
        metric(
            &m,
            "equiroute_rollout_events_total{interface=\"chat\",event=\"promote\"} "
        ),
        Some(1.0),
        "{m}"
    );
}

#[test]
fn shadow_and_rollout_errors_name_the_field_and_the_fix() {
    let base = config("127.0.0.1:9".parse().unwrap(), "LINES", "");
    for (lines, field, says) in [
        ("shadow = \"lqmx\"", "interfaces.chat.shadow", "lqm-ts"),
        (
            "shadow = \"oracle\"",
            "interfaces.chat.shadow",
            "only in the laboratory",
        ),
        (
            "shadow = { name = \"static\", candidate = \"z\" }",
            "interfaces.chat.shadow",
            "z",
        ),
        (
            "rollout = { policy = \"lqm\", percent = 0 }",
            "interfaces.chat.rollout.percent",
            "above 0",
        ),
        (
            "rollout = { policy = \"lqm\", percent = 100 }",
            "interfaces.chat.rollout.percent",
            "below 100",
        ),
        (
            "rollout = { policy = \"lqm\", percent = 5, guard = { confidence = 1 } }",
            "interfaces.chat.rollout.guard.confidence",
            "[0.5, 1)",
        ),
        (
            "rollout = { policy = \"lqm\", percent = 5, guard = { bad_rate_margin = -0.1 } }",
            "interfaces.chat.rollout.guard.bad_rate_margin",
            "[0, 1)",
        ),
        (
            "rollout = { policy = \"lqm\", percent = 5, guard = { tuned_for = 0 } }",
            "interfaces.chat.rollout.guard.tuned_for",
            "at least 1",
        ),
        (
            "rollout = { policy = { name = \"static\", candidate = \"z\" }, percent = 5 }",
            "interfaces.chat.rollout.policy",
            "z",
        ),
        (
            "rollout = { percent = 5 }",
            "interfaces.chat.rollout",
            "policy",
        ),
        (
            "rollout = { policy = \"lqm\", percent = 5, share = 3 }",
            "interfaces.chat.rollout",
            "share",
        ),
    ] {
        let e = equiroute_gateway::config::load(&base.replace("LINES", lines), "x.toml", &|_| None)
            .unwrap_err();
        assert!(e.field.starts_with(field), "{lines}: {e}");
        assert!(e.to_string().contains(says), "{lines}: {e}");
    }
    let ok = equiroute_gateway::config::load(
        &base.replace(
            "LINES",
            "shadow = { name = \"lqm\", l_ref_ms = 900 }\nrollout = { policy = \"ts-deadline\", percent = 5, guard = { bad_rate_margin = 0.02, quality_margin = 0.1, confidence = 0.99, tuned_for = 500 } }",
        ),
        "x.toml",
        &|_| None,
    )
    .unwrap();
    let r = ok.interfaces[0].rollout.as_ref().unwrap();
    assert_eq!(
        (r.percent, r.guard.confidence, r.guard.tuned_for),
        (5.0, 0.99, 500)
    );
}

#[tokio::test]
async fn each_arm_logs_its_own_policy_s_propensity_and_how_it_is_known() {
    let upstream = mock("").await;
    let audit = std::env::temp_dir().join(format!(
        "equiroute-rollout-propensity-{}.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&audit);
    // A deterministic live policy beside a uniformly random canary: the canary's requests
    // must carry the random policy's exact 1/2, not the live policy's "deterministic".
    let gw = start(
        &format!(
            "[audit]\npath = {:?}\n{}",
            audit.display().to_string(),
            config(
                upstream.addr,
                "policy = { name = \"static\", candidate = \"a\" }\n\
                 rollout = { policy = \"random\", percent = 50 }",
                "",
            )
        ),
        &[],
    )
    .await;
    let n = 40;
    for i in 0..n {
        assert_eq!(chat(gw.addr, &format!("session-{i}")).await.status, 200);
    }
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let records: Vec<Value> = loop {
        let text = std::fs::read_to_string(&audit).unwrap_or_default();
        let records: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|r| r["kind"] == "request")
            .collect();
        if records.len() >= n {
            break records;
        }
        assert!(std::time::Instant::now() < until, "{text}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    };
    let arm = |policy: &str| -> Vec<&Value> {
        records.iter().filter(|r| r["policy"] == policy).collect()
    };
    let (live, canary) = (arm("static"), arm("random"));
    assert_eq!(live.len() + canary.len(), n, "{records:?}");
    assert!(!live.is_empty() && !canary.is_empty(), "{records:?}");
    for r in live {
        assert_eq!(r["propensity_kind"], "deterministic", "{r}");
        assert_eq!(r["propensity"], 1.0, "{r}");
    }
    for r in canary {
        assert_eq!(r["propensity_kind"], "exact", "{r}");
        assert_eq!(r["propensity"], 0.5, "{r}");
    }
    let _ = std::fs::remove_file(&audit);
}

/// A state file in a fresh temporary directory.
fn state_file(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("equiroute-rollout-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("state.redb")
}

#[tokio::test]
async fn a_rolled_back_canary_stays_rolled_back_across_a_restart() {
    let upstream = mock("[models.\"m-a\"]\nfault = \"unavailable\"\n").await;
    let path = state_file("rolled-back");
    let text = format!(
        "[state]\npath = {:?}\nsnapshot_interval_s = 3600\n{}",
        path.display().to_string(),
        config(
            upstream.addr,
            "policy = { name = \"static\", candidate = \"b\" }\n\
             breaker = { consecutive_failures = 1000, window = 64, min_attempts = 64, failure_rate = 1.0 }\n\
             rollout = { policy = { name = \"static\", candidate = \"a\" }, percent = 50, guard = { tuned_for = 20 } }",
            "",
        )
    );
    let mut report = Value::Null;
    common::serve_until(&text, |addr| async move {
        for i in 0..ROLLBACK_BOUND {
            chat(addr, &format!("session-{i}")).await;
            if get(addr, "/v1/interfaces/chat/rollout").await["status"]["state"] == "rolled_back" {
                break;
            }
        }
    })
    .await
    .unwrap();
    let failed = calls(upstream.addr, "m-a").await;
    assert!(failed >= 10, "the canary was tried: {failed}");
    // After the restart the canary is still rolled back, with its evidence: none of the
    // sessions that were on it goes to the failing provider again.
    let report_ref = &mut report;
    common::serve_until(&text, |addr| async move {
        *report_ref = get(addr, "/v1/interfaces/chat/rollout").await;
        for i in 0..ROLLBACK_BOUND {
            let r = chat(addr, &format!("session-{i}")).await;
            assert_eq!(r.routed(), (200, Some("b"), Some("1")), "{}", r.body);
        }
    })
    .await
    .unwrap();
    assert_eq!(report["status"]["state"], "rolled_back", "{report}");
    assert_eq!(report["status"]["metric"], "bad_rate", "{report}");
    assert_eq!(
        report["arms"]["candidate"]["requests"].as_u64(),
        Some(failed),
        "{report}"
    );
    assert_eq!(calls(upstream.addr, "m-a").await, failed);
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[tokio::test]
async fn a_promotion_survives_a_restart_with_the_promoted_policy_s_learning() {
    let upstream = mock("").await;
    let path = state_file("promoted");
    let text = format!(
        "[state]\npath = {:?}\nsnapshot_interval_s = 3600\n{}",
        path.display().to_string(),
        config(
            upstream.addr,
            "policy = { name = \"static\", candidate = \"a\" }\n\
             rollout = { policy = \"least-latency\", percent = 50 }",
            "",
        )
    );
    common::serve_until(&text, |addr| async move {
        for i in 0..20 {
            assert_eq!(chat(addr, &format!("session-{i}")).await.status, 200);
        }
        let r = http(addr, "POST", "/v1/interfaces/chat/rollout/promote", &[], "").await;
        assert_eq!(r.status, 200, "{}", r.body);
        for i in 0..10 {
            assert_eq!(chat(addr, &format!("after-{i}")).await.status, 200);
        }
    })
    .await
    .unwrap();
    // Before: the saved live state (least-latency's) was refused by the configured `static`,
    // and the gateway did not start.
    let mut seen = (Value::Null, Value::Null);
    let seen_ref = &mut seen;
    common::serve_until(&text, |addr| async move {
        *seen_ref = (
            get(addr, "/v1/interfaces/chat/rollout").await,
            get(addr, "/v1/interfaces/chat/state").await,
        );
    })
    .await
    .unwrap();
    let (rollout, state) = seen;
    assert_eq!(rollout["status"]["state"], "promoted", "{rollout}");
    assert_eq!(rollout["live_policy"], "least-latency", "{rollout}");
    assert_eq!(state["policy"], "least-latency", "{state}");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}
