//! Reloading the configuration without a restart (issue 46, bar 2), on a real gateway on a
//! loopback port reading its configuration from a file: a valid change applies while a
//! streamed and an unstreamed request started before it finish on the configuration they
//! started with; an invalid file, or a change that needs a restart, is refused and the running
//! configuration keeps serving; the learnt state of an interface or a provider the reload did
//! not change is identical before and after.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, metric, mock, streamed_text};
use equiroute_gateway::config::ConfigSource;
use serde_json::Value;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A gateway serving the configuration in the file at `path`, which it reads again on a
/// reload; stopped when dropped.
struct FromFile {
    addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start_from(path: &Path) -> FromFile {
    let source = ConfigSource::file(path);
    let cfg = source.read().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let prepared = equiroute_gateway::prepare(&cfg)
        .await
        .unwrap()
        .with_source(source);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(prepared.serve(listener, Vec::new(), async {
        let _ = stopped.await;
    }));
    FromFile { addr, _stop: stop }
}

/// A file of this test's own (removed first if a previous run left it).
fn config_file(name: &str, text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "equiroute-reload-{name}-{}.toml",
        std::process::id()
    ));
    std::fs::write(&path, text).unwrap();
    path
}

async fn reload(addr: SocketAddr) -> (u16, Value) {
    let reply = http(addr, "POST", "/v1/admin/reload", &[], "").await;
    (reply.status, reply.json())
}

async fn chat(addr: SocketAddr, model: &str) -> common::Reply {
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"hello"}}]}}"#);
    http(addr, "POST", "/v1/chat/completions", &[], &body).await
}

async fn scraped(addr: SocketAddr) -> String {
    http(addr, "GET", "/metrics", &[], "").await.body
}

/// An OpenAI-compatible provider `id` on the mock at `at`, answering as `model`.
fn openai(interface: &str, id: &str, model: &str, at: SocketAddr, price: f64) -> String {
    format!(
        "[[interfaces.{interface}.providers]]\nid = \"{id}\"\nkind = \"openai\"\nmodel = \"{model}\"\nbase_url = \"http://{at}/v1\"\nprice = {{ per_million_input_tokens = {price}, per_million_output_tokens = {price} }}\n"
    )
}

/// Bar 2: a valid change (a provider added, a price changed) applies without dropping a
/// streamed or an unstreamed request in flight: both finish, on the provider they started
/// on, after the reload answered.
#[tokio::test]
async fn a_valid_change_applies_while_requests_in_flight_finish_on_their_configuration() {
    // The slow model answers after about 1.5 s, and streams with 300 ms between chunks.
    let upstream = mock(
        "[models.slow]\nlatency = { p50_ms = 1500, p95_ms = 1600 }\nchunk_gap_ms = 300\n\
         [models.fast]\nlatency = { p50_ms = 1, p95_ms = 2 }\n",
    )
    .await;
    let head = "[interfaces.chat]\nkind = \"chat\"\npolicy = { name = \"static\", candidate = \"a\" }\ndeadline_ms = 20000\n";
    let before = format!("{head}{}", openai("chat", "a", "slow", upstream.addr, 1.0));
    let path = config_file("valid", &before);
    let gw = start_from(&path).await;
    assert_eq!(chat(gw.addr, "chat/b").await.status, 404, "no `b` yet");

    let unstreamed = tokio::spawn(chat(gw.addr, "chat"));
    let stream_body =
        r#"{"model":"chat","stream":true,"messages":[{"role":"user","content":"hello"}]}"#;
    let streamed = tokio::spawn(http(
        gw.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        stream_body,
    ));
    // Both are in flight once the mock has them (it answers 1.5 s later).
    let until = Instant::now() + Duration::from_secs(10);
    while common::calls(upstream.addr, "slow").await < 2 {
        assert!(Instant::now() < until, "the mock never got both requests");
        tokio::task::yield_now().await;
    }

    // `b` joins, first; `a`'s price changes, and the policy learns quality.
    let after = format!(
        "[interfaces.chat]\nkind = \"chat\"\npolicy = {{ name = \"lqm-ts\" }}\ndeadline_ms = 20000\n{}{}",
        openai("chat", "b", "fast", upstream.addr, 1.0),
        openai("chat", "a", "slow", upstream.addr, 2.0)
    );
    std::fs::write(&path, after).unwrap();
    let (status, body) = reload(gw.addr).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        !unstreamed.is_finished() && !streamed.is_finished(),
        "the reload was meant to happen while both were in flight"
    );
    assert_eq!(body["status"], "applied");
    assert_eq!(body["version"], 2);
    assert_eq!(body["added"], serde_json::json!([]));
    assert_eq!(body["changed"][0]["interface"], "chat");
    assert_eq!(
        body["changed"][0]["providers_added"],
        serde_json::json!(["b"])
    );
    assert_eq!(
        body["changed"][0]["providers_removed"],
        serde_json::json!([])
    );
    assert_eq!(body["changed"][0]["learnt"], "by_provider");

    // The requests in flight finish, whole, on `a`.
    let unstreamed = unstreamed.await.unwrap();
    assert_eq!(unstreamed.routed().0, 200, "{}", unstreamed.body);
    assert_eq!(unstreamed.header("x-equiroute-provider"), Some("a"));
    let streamed = streamed.await.unwrap();
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    assert_eq!(streamed.header("x-equiroute-provider"), Some("a"));
    let (text, markers) = streamed_text(&streamed.body);
    assert_eq!(text, "mock streamed answer", "{}", streamed.body);
    assert!(markers.is_empty(), "{markers:?}");
    assert!(streamed.body.contains("data: [DONE]"), "{}", streamed.body);

    // The new configuration serves: `b` can be pinned, and the interface lists it.
    let pinned = chat(gw.addr, "chat/b").await;
    assert_eq!(pinned.routed().0, 200, "{}", pinned.body);
    assert_eq!(pinned.header("x-equiroute-provider"), Some("b"));
    let listed = http(gw.addr, "GET", "/v1/interfaces", &[], "").await.json();
    let prices: Vec<f64> = listed["interfaces"][0]["providers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["price"]["per_million_input_tokens"].as_f64().unwrap())
        .collect();
    assert_eq!(prices, [1.0, 2.0], "{listed}");

    // The request that finished on the old runtime is scored on `a`, now the second provider.
    let id = unstreamed.header("x-equiroute-request-id").unwrap();
    let score = format!(r#"{{"request_id":"{id}","quality":0.9}}"#);
    let scored = http(gw.addr, "POST", "/v1/feedback", &[], &score).await;
    assert_eq!(scored.status, 200, "{}", scored.body);
    let scores = quality_observations(gw.addr, "chat").await;
    assert_eq!((scores["a"], scores["b"]), (1, 0), "{scores:?}");

    let text = scraped(gw.addr).await;
    assert_eq!(
        metric(&text, "equiroute_config_reloads_total{outcome=\"applied\"}"),
        1
    );
    assert_eq!(
        metric(&text, "equiroute_config_reloads_total{outcome=\"refused\"}"),
        0
    );
    assert_eq!(metric(&text, "equiroute_config_version"), 2);
    // `b`'s series exist from the reload on.
    assert!(
        text.contains("equiroute_attempts_total{interface=\"chat\",provider=\"b\",status=\"ok\"}"),
        "{text}"
    );
    let _ = std::fs::remove_file(&path);
}

/// Bar 2: an invalid file is refused with the error (its field and fix), the running
/// configuration keeps serving, and the refusal is counted; so is a change that needs a
/// restart, which names the setting.
#[tokio::test]
async fn an_invalid_file_is_refused_and_the_running_configuration_keeps_serving() {
    let upstream = mock("").await;
    let good = format!(
        "[interfaces.chat]\nkind = \"chat\"\n{}",
        openai("chat", "a", "m", upstream.addr, 1.0)
    );
    let path = config_file("invalid", &good);
    let gw = start_from(&path).await;
    assert_eq!(chat(gw.addr, "chat").await.status, 200);

    // A typo in a provider's field.
    std::fs::write(&path, good.replace("base_url", "base_ulr")).unwrap();
    let (status, body) = reload(gw.addr).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "invalid_configuration", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("base_ulr"), "{message}");
    assert!(
        message.contains("running configuration is kept"),
        "{message}"
    );

    // Still served, by the old configuration.
    let answer = chat(gw.addr, "chat").await;
    assert_eq!(answer.routed().0, 200, "{}", answer.body);
    assert_eq!(answer.header("x-equiroute-provider"), Some("a"));

    // A setting the running gateway set up at start.
    std::fs::write(&path, format!("[server]\nmax_body_bytes = 4096\n{good}")).unwrap();
    let (status, body) = reload(gw.addr).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "restart_needed", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("restart needed for server.max_body_bytes"),
        "{message}"
    );

    let text = scraped(gw.addr).await;
    assert_eq!(
        metric(&text, "equiroute_config_reloads_total{outcome=\"refused\"}"),
        2
    );
    assert_eq!(
        metric(&text, "equiroute_config_reloads_total{outcome=\"applied\"}"),
        0
    );
    assert_eq!(metric(&text, "equiroute_config_version"), 1);
    let dashboard = http(gw.addr, "GET", "/dashboard/data", &[], "")
        .await
        .json();
    assert_eq!(dashboard["config"]["version"], 1, "{dashboard}");

    // Fixed, it applies.
    std::fs::write(&path, &good).unwrap();
    let (status, body) = reload(gw.addr).await;
    assert_eq!(
        (status, &body["unchanged"]),
        (200, &serde_json::json!(["chat"]))
    );
    let _ = std::fs::remove_file(&path);
}

/// A gateway given its configuration in memory has no file to read again.
#[tokio::test]
async fn a_gateway_without_a_file_refuses_to_reload() {
    let gw = common::start(
        "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 1, p95_ms = 2 } }\n",
        &[],
    )
    .await;
    let (status, body) = reload(gw.addr).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "reload_unavailable");
}

/// With keys configured, the route takes the admin keys only, as the state routes do.
#[tokio::test]
async fn the_reload_route_takes_the_admin_keys() {
    let gw = common::start(
        "[server]\napi_keys_env = [\"CLIENT\"]\nadmin_keys_env = [\"ADMIN\"]\n[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 1, p95_ms = 2 } }\n",
        &[("CLIENT", "client-key"), ("ADMIN", "admin-key")],
    )
    .await;
    for (key, status) in [
        (None, 401),
        (Some("Bearer client-key"), 401),
        // Past the key check: this gateway has no file to read.
        (Some("Bearer admin-key"), 409),
    ] {
        let headers: Vec<(&str, &str)> = key.map(|k| ("authorization", k)).into_iter().collect();
        let reply = http(gw.addr, "POST", "/v1/admin/reload", &headers, "").await;
        assert_eq!(reply.status, status, "{key:?}: {}", reply.body);
    }
}

/// How many quality scores each provider of interface `name` has learnt from.
async fn quality_observations(
    addr: SocketAddr,
    name: &str,
) -> std::collections::BTreeMap<String, u64> {
    let state = http(
        addr,
        "GET",
        &format!("/v1/interfaces/{name}/state"),
        &[],
        "",
    )
    .await
    .json();
    state["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let n = c["estimates"]["quality_observations"].as_u64().unwrap();
            (c["id"].as_str().unwrap().to_owned(), n)
        })
        .collect()
}

/// The learnt statistics, and the breakers, of interface `name` (`?full=true`).
async fn learnt(addr: SocketAddr, name: &str) -> (Value, Vec<Value>) {
    let state = http(
        addr,
        "GET",
        &format!("/v1/interfaces/{name}/state?full=true"),
        &[],
        "",
    )
    .await
    .json();
    // By id: the ranking's order may change with the time.
    let mut breakers: Vec<Value> = state["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| serde_json::json!({"id": c["id"], "breaker": c["breaker"]}))
        .collect();
    breakers.sort_by_key(|b| b["id"].to_string());
    (state["learning_state"].clone(), breakers)
}

fn sim(interface: &str, id: &str, price: f64) -> String {
    format!(
        "[[interfaces.{interface}.providers]]\nid = \"{id}\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 2, p95_ms = 4 }} }}\nprice = {{ per_million_input_tokens = {price}, per_million_output_tokens = {price} }}\n"
    )
}

/// Bar 2: the learnt state of an interface the reload did not change, and of an interface
/// whose providers stayed the same while one's price changed, is identical before and after.
#[tokio::test]
async fn the_learnt_state_of_what_did_not_change_is_identical_after_a_reload() {
    let chat = format!(
        "[interfaces.chat]\nkind = \"chat\"\npolicy = {{ name = \"lqm-ts\" }}\n{}{}",
        sim("chat", "a", 1.0),
        sim("chat", "b", 2.0)
    );
    let other = |providers: &str| format!("[interfaces.other]\nkind = \"chat\"\n{providers}");
    let path = config_file(
        "learnt",
        &format!("{chat}{}", other(&sim("other", "x", 1.0))),
    );
    let gw = start_from(&path).await;
    for _ in 0..30 {
        assert_eq!(chat_request(gw.addr, "chat").await, 200);
    }
    for _ in 0..5 {
        assert_eq!(chat_request(gw.addr, "other").await, 200);
    }
    let before = learnt(gw.addr, "chat").await;
    assert_ne!(
        before.0["quality"]["heads"]["tries"],
        serde_json::json!([0, 0]),
        "it learnt something: {}",
        before.0
    );

    // Another interface changes (a provider added): `chat` keeps its runtime.
    let other_grown = other(&format!(
        "{}{}",
        sim("other", "x", 1.0),
        sim("other", "y", 1.0)
    ));
    std::fs::write(&path, format!("{chat}{other_grown}")).unwrap();
    let (status, body) = reload(gw.addr).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["unchanged"], serde_json::json!(["chat"]));
    assert_eq!(body["changed"][0]["interface"], "other");
    assert_eq!(body["changed"][0]["learnt"], "by_provider");
    assert_eq!(learnt(gw.addr, "chat").await, before);

    // `b`'s price changes: `chat` is rebuilt with everything it learnt.
    let repriced = format!(
        "[interfaces.chat]\nkind = \"chat\"\npolicy = {{ name = \"lqm-ts\" }}\n{}{}",
        sim("chat", "a", 1.0),
        sim("chat", "b", 3.0)
    );
    std::fs::write(&path, format!("{repriced}{other_grown}")).unwrap();
    let (status, body) = reload(gw.addr).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["changed"][0]["interface"], "chat", "{body}");
    assert_eq!(body["changed"][0]["learnt"], "all", "{body}");
    assert_eq!(body["version"], 3);
    let after = learnt(gw.addr, "chat").await;
    let mut differ = Vec::new();
    diff("", &before.0, &after.0, &mut differ);
    assert!(differ.is_empty(), "{differ:?}");
    assert_eq!(after, before);
    let _ = std::fs::remove_file(&path);
}

async fn chat_request(addr: SocketAddr, model: &str) -> u16 {
    chat(addr, model).await.status
}

/// With Redis, the namespace records the interfaces' shape: a reload that changes it is
/// refused (the instances would no longer share one state), one that keeps it applies, with
/// the interface's learning kept.
#[test]
fn with_redis_a_reload_keeps_the_namespaces_shape_or_is_refused() {
    use equiroute_gateway::server::reload::{apply, ReloadError};
    let load = |text: &str| {
        let text = format!("[state]\nbackend = \"redis\"\nurl_env = \"REDIS_URL\"\n{text}");
        equiroute_gateway::config::load(&text, "test.toml", &|_| {
            Some("redis://127.0.0.1:1".to_owned())
        })
        .unwrap()
    };
    let chat = |policy: &str, price: f64| {
        format!(
            "[interfaces.chat]\nkind = \"chat\"\npolicy = {{ name = \"{policy}\" }}\n{}{}",
            sim("chat", "a", 1.0),
            sim("chat", "b", price)
        )
    };
    // Never connected: the shape check needs no Redis.
    let state =
        equiroute_gateway::server::state::AppState::new(&load(&chat("lqm-ts", 1.0)), 1).unwrap();
    for (next, why) in [
        (
            chat("lqm", 1.0),
            "interface `chat`: its policy would change",
        ),
        (
            format!(
                "{}{}",
                chat("lqm-ts", 1.0),
                "[interfaces.more]\nkind = \"chat\"\n"
            ) + &sim("more", "m", 1.0),
            "the interfaces would change",
        ),
    ] {
        match apply(&state, load(&next)) {
            Err(e @ ReloadError::SharedShape(_)) => {
                assert!(e.to_string().contains(why), "{e}");
                assert!(e.to_string().starts_with("restart needed"), "{e}");
            }
            other => panic!("{why}: {other:?}"),
        }
    }
    // Another namespace: the syncer was set up at start.
    let mut other_namespace = load(&chat("lqm-ts", 1.0));
    if let Some(equiroute_gateway::config::StateConfig::Redis(r)) = &mut other_namespace.state {
        r.namespace = "elsewhere".to_owned();
    }
    match apply(&state, other_namespace) {
        Err(ReloadError::RestartNeeded(what)) => assert_eq!(what, ["[state]"]),
        other => panic!("{other:?}"),
    }
    // A price keeps the shape: applied, everything learnt kept.
    let done = apply(&state, load(&chat("lqm-ts", 2.0))).unwrap();
    assert_eq!(done.version, 2);
    assert_eq!(done.changed[0].learnt, "all");
}

/// The paths at which `a` and `b` differ, with both values.
fn diff(at: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))) {
                diff(
                    &format!("{at}.{k}"),
                    &x[k.as_str()],
                    y.get(k).unwrap_or(&Value::Null),
                    out,
                );
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                diff(&format!("{at}[{i}]"), p, q, out);
            }
        }
        _ if a != b => out.push(format!("{at}: {a} vs {b}")),
        _ => {}
    }
}
