//! Learning state survives a restart; an unusable state file is refused with the way out.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, serve_until as run};
use serde_json::{json, Value};
use std::fmt::Write as _;

fn config(path: &std::path::Path, providers: &[&str]) -> String {
    let mut s = format!(
        "[state]\npath = {:?}\nsnapshot_interval_s = 3600\n[interfaces.search]\nkind = \"tool\"\npolicy = {{ name = \"lqm\" }}\n",
        path.display().to_string()
    );
    for p in providers {
        let _ = write!(s, "[[interfaces.search.providers]]\nid = \"{p}\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 2, p95_ms = 4 }} }}\n");
    }
    s
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("equiroute-state-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("state.redb")
}

async fn quality(addr: std::net::SocketAddr) -> f64 {
    let v = http(addr, "GET", "/v1/interfaces/search/state", &[], "")
        .await
        .json();
    v["candidates"][0]["estimates"]["quality"].as_f64().unwrap()
}

#[tokio::test]
async fn learned_state_and_pending_feedback_survive_a_restart() {
    let path = temp("restart");
    let text = config(&path, &["s1"]);
    let first = std::sync::Arc::new(std::sync::Mutex::new((0.0, String::new())));
    let out = first.clone();
    run(&text, |addr| async move {
        let r = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"rust"}"#).await;
        let id = r.header("x-equiroute-request-id").unwrap().to_owned();
        let fb = json!({"request_id": id, "quality": 1.0}).to_string();
        assert_eq!(
            http(addr, "POST", "/v1/feedback", &[], &fb).await.status,
            200
        );
        let learned = quality(addr).await;
        // A second answered request whose feedback arrives only after the restart.
        let r = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"rust"}"#).await;
        *out.lock().unwrap() = (
            learned,
            r.header("x-equiroute-request-id").unwrap().to_owned(),
        );
    })
    .await
    .unwrap();
    let (learned, pending_id) = first.lock().unwrap().clone();
    assert!(learned > 0.05, "the first run learnt something: {learned}");
    run(&text, |addr| async move {
        let restored = quality(addr).await;
        assert!(
            (restored - learned).abs() < 1e-9,
            "restored {restored} vs learned {learned}"
        );
        // The estimate and the scores behind it are restored; the traffic counts cover this
        // process only, and say so.
        let state = http(addr, "GET", "/v1/interfaces/search/state", &[], "")
            .await
            .json();
        assert_eq!(
            state["candidates"][0]["estimates"]["quality_observations"],
            1
        );
        assert_eq!(state["candidates"][0]["first_choices"], 0);
        assert_eq!(state["candidates"][0]["traffic_share"], Value::Null);
        assert_eq!(state["traffic_window"]["requests"], 0);
        assert_eq!(state["traffic_window"]["scope"], "process");
        let fb = json!({"request_id": pending_id, "quality": 1.0}).to_string();
        let r = http(addr, "POST", "/v1/feedback", &[], &fb).await;
        assert_eq!(
            (r.status, r.json()["status"].clone()),
            (200, json!("accepted")),
            "{}",
            r.body
        );
        assert!(
            quality(addr).await > restored,
            "the late feedback updated the same candidate"
        );
    })
    .await
    .unwrap();
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[tokio::test]
async fn an_incompatible_or_corrupt_state_file_is_refused_with_the_way_out() {
    let path = temp("refuse");
    run(&config(&path, &["s1"]), |addr| async move {
        let _ = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"x"}"#).await;
    })
    .await
    .unwrap();
    let e = run(&config(&path, &["s1", "s2"]), |_| async {})
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("had providers") && e.contains("--reset-state"),
        "{e}"
    );
    assert!(path.exists(), "never wiped silently");
    std::fs::write(&path, b"this is not a database").unwrap();
    let e = run(&config(&path, &["s1"]), |_| async {})
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cannot be opened") && e.contains("--reset-state"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// redb's locks belong to an open of the file, not to the process: a second open in the same
/// process is told the file is held (by this process), never that it is damaged; nor can it
/// be removed or exported meanwhile. Once the first open is dropped, all three work.
#[test]
fn a_second_open_in_the_same_process_is_told_the_file_is_held() {
    use equiroute_gateway::store::{Store, StoreError};
    let path = temp("held-in-process");
    let first = Store::open(&path).unwrap();
    let held = |e: StoreError| {
        let text = e.to_string();
        assert!(matches!(e, StoreError::Locked { .. }), "{e:?}");
        assert!(
            text.contains(&format!("this process (pid {})", std::process::id())),
            "{text}"
        );
        assert!(!text.contains("--reset-state"), "{text}");
    };
    held(Store::open(&path).unwrap_err());
    held(Store::export_file(&path).unwrap_err());
    held(Store::remove(&path).unwrap_err());
    assert!(path.exists());
    drop(first);
    assert!(matches!(
        Store::export_file(&path),
        Err(StoreError::NothingSaved { .. })
    ));
    drop(Store::open(&path).unwrap());
    assert!(Store::remove(&path).unwrap(), "there was a file to remove");
    assert!(!path.exists());
    assert!(!Store::remove(&path).unwrap(), "nothing left to remove");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}
