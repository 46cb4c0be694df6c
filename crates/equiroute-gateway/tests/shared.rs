//! Learning state shared through a real `redis-server`, started by each test on a free
//! loopback port and stopped by PID. Without the binary the tests skip with a message.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

mod common;

use common::redis::RedisServer;
use equiroute_core::policies::Observation;
use equiroute_core::{
    AttemptOutcome, AttemptStatus, Millis, ProviderFailure, SlicePath, Timestamp,
};
use equiroute_gateway::config::load;
use equiroute_gateway::server::state::AppState;
use equiroute_gateway::shared::Syncer;
use serde_json::Value;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

fn config(url: Option<&str>, namespace: &str) -> String {
    let state = url.map_or(String::new(), |u| {
        format!("[state]\nbackend = \"redis\"\nurl = \"{u}\"\nnamespace = \"{namespace}\"\nsync_interval_ms = 50\n")
    });
    let mut s = format!(
        "{state}[interfaces.chat]\nkind = \"chat\"\nfeature_dim = 16\npolicy = {{ name = \"lqm-ts\", lqm = {{ head = {{ window = 25 }} }} }}\n"
    );
    for p in ["a", "b", "c"] {
        let _ = writeln!(
            s,
            "[[interfaces.chat.providers]]\nid = \"{p}\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 2, p95_ms = 4 }} }}"
        );
    }
    s
}

fn app(text: &str, seed: u64) -> AppState {
    AppState::new(&load(text, "t.toml", &|_| None).unwrap(), seed).unwrap()
}

/// `n` observations with varied candidates, features, latencies, failures, censored
/// timeouts, quality scores and out-of-order timestamps.
fn workload(n: usize) -> Vec<Observation> {
    let t0 = 1.7e12;
    (0..n)
        .map(|k| {
            let candidate = (k * 7 + k / 5) % 3;
            let features: Vec<f64> = (0..16)
                .map(|j| {
                    (((k * 31 + j * 17) % 23) as f64 / 23.0 - 0.5) * if j == 0 { 0.0 } else { 1.0 }
                        + if j == 0 { 1.0 } else { 0.0 }
                })
                .collect();
            // Times go back and forth across instances: 97 is prime to n.
            let now = Timestamp(t0 + ((k * 97) % n) as f64 * 13.0);
            if k % 2 == 1 {
                Observation::Quality {
                    candidate,
                    features,
                    quality: ((k * 13) % 10) as f64 / 10.0,
                    latency: Millis(50.0 + (k % 9) as f64 * 10.0),
                    now,
                }
            } else {
                let status = match k % 10 {
                    4 => AttemptStatus::ProviderError(ProviderFailure::Server),
                    8 => AttemptStatus::Timeout,
                    _ => AttemptStatus::Ok,
                };
                let mut outcome =
                    AttemptOutcome::with_status(40.0 + ((k * 37) % 200) as f64, status);
                if status == AttemptStatus::Timeout {
                    outcome.latency = Millis(300.0);
                }
                Observation::Attempt {
                    candidate,
                    features,
                    slice: SlicePath::root(),
                    deadline: Some(Millis(300.0)),
                    outcome,
                    now,
                }
            }
        })
        .collect()
}

/// Counts equal exactly; other numbers to 1e-9 relative.
fn assert_close(a: &Value, b: &Value, path: &str) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            assert_eq!(
                x.keys().collect::<Vec<_>>(),
                y.keys().collect::<Vec<_>>(),
                "{path}"
            );
            for (k, v) in x {
                assert_close(v, &y[k], &format!("{path}.{k}"));
            }
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{path}: lengths");
            for (i, (v, w)) in x.iter().zip(y).enumerate() {
                assert_close(v, w, &format!("{path}[{i}]"));
            }
        }
        (Value::Number(x), Value::Number(y)) => {
            if let (Some(p), Some(q)) = (x.as_u64(), y.as_u64()) {
                assert_eq!(p, q, "{path}: count");
            } else {
                let (p, q) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                let scale = p.abs().max(q.abs()).max(1e-300);
                assert!(
                    (p - q).abs() <= 1e-9 * scale || (p - q).abs() < 1e-12,
                    "{path}: {p} vs {q}"
                );
            }
        }
        _ => assert_eq!(a, b, "{path}"),
    }
}

fn live_state(app: &AppState) -> Value {
    let iface = app.interface("chat").unwrap();
    let state = iface.policy.read().unwrap().export_state();
    serde_json::to_value(state).unwrap()
}

/// Two instances of `text` (ids 1 and 2), each with its syncer started.
async fn two_instances(text: &str) -> (AppState, AppState, Syncer, Syncer) {
    let (a, b) = (app(text, 1), app(text, 2));
    let sa = Syncer::start(&redis_cfg(text), &a).await.unwrap();
    let sb = Syncer::start(&redis_cfg(text), &b).await.unwrap();
    (a, b, sa, sb)
}

fn feed(app: &AppState, obs: &[Observation]) {
    let iface = app.interfaces()["chat"].clone();
    for o in obs {
        app.observe(&iface, o.clone()).unwrap();
    }
}

/// Records `o`, when it is an attempt, as one the rollout's candidate routed on `app` (its
/// canary arm); `false` for other observations.
fn route_to_candidate(app: &AppState, o: Observation) -> bool {
    let Observation::Attempt {
        candidate,
        features,
        slice,
        deadline,
        outcome,
        ..
    } = o
    else {
        return false;
    };
    let iface = app.interfaces()["chat"].clone();
    let arm = equiroute_gateway::server::arms::Arm::Candidate;
    app.record_routed_attempt(&iface, arm, candidate, &features, slice, &outcome, deadline)
        .unwrap();
    true
}

#[tokio::test]
async fn three_instances_hold_the_statistics_of_one_instance_that_saw_everything() {
    let Some(redis) = RedisServer::start("exact") else {
        return;
    };
    let text = config(Some(&redis.url()), "exact");
    let apps: Vec<AppState> = (0..3).map(|i| app(&text, i)).collect();
    let mut syncers = Vec::new();
    for a in &apps {
        syncers.push(Syncer::start(&redis_cfg(&text), a).await.unwrap());
    }
    let n = 600;
    let all = workload(n);
    // Instance i gets every third observation, starting at i.
    let parts: Vec<Vec<Observation>> = (0..3)
        .map(|i| all.iter().skip(i).step_by(3).cloned().collect())
        .collect();
    for (a, p) in apps.iter().zip(&parts) {
        feed(a, p);
    }
    // One sync interval: each instance pushes (in this order) and pulls; the first two
    // pull again to see what was pushed after them.
    for (s, a) in syncers.iter_mut().zip(&apps) {
        s.sync_once(a).await.unwrap();
    }
    for (s, a) in syncers.iter_mut().zip(&apps).take(2) {
        s.sync_once(a).await.unwrap();
    }
    // The single instance sees the same observations in the log's order.
    let single = app(&config(None, ""), 9);
    for p in &parts {
        feed(&single, p);
    }
    let expected = live_state(&single);
    let quality_counts: u64 = expected["quality"]["heads"]["heads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["count"].as_u64().unwrap())
        .sum();
    assert_eq!(
        quality_counts,
        (n / 2) as u64,
        "every quality score counted once"
    );
    for (i, (a, s)) in apps.iter().zip(&syncers).enumerate() {
        assert_close(&live_state(a), &expected, &format!("instance {i} live"));
        let confirmed = serde_json::to_value(&s.confirmed_states()["chat"]).unwrap();
        assert_close(&confirmed, &expected, &format!("instance {i} confirmed"));
    }
}

fn redis_cfg(text: &str) -> equiroute_gateway::config::RedisStateConfig {
    match load(text, "t.toml", &|_| None).unwrap().state {
        Some(equiroute_gateway::config::StateConfig::Redis(r)) => r,
        other => panic!("not a redis config: {other:?}"),
    }
}

#[tokio::test]
async fn an_outage_loses_nothing_and_counts_nothing_twice() {
    let Some(mut redis) = RedisServer::start("outage") else {
        return;
    };
    let text = config(Some(&redis.url()), "outage");
    let apps: Vec<AppState> = (0..2).map(|i| app(&text, 10 + i)).collect();
    let mut syncers = Vec::new();
    for a in &apps {
        syncers.push(Syncer::start(&redis_cfg(&text), a).await.unwrap());
    }
    let all = workload(400);
    let (before, after) = all.split_at(120);
    // Before the outage: each instance learns half, and syncs.
    feed(&apps[0], &before[..60]);
    feed(&apps[1], &before[60..]);
    for (s, a) in syncers.iter_mut().zip(&apps) {
        s.tick(a).await;
    }
    redis.kill();
    // During the outage both keep learning (and routing) on local state.
    feed(&apps[0], &after[..140]);
    feed(&apps[1], &after[140..]);
    for (s, a) in syncers.iter_mut().zip(&apps) {
        s.tick(a).await;
    }
    let shared = apps[0].shared.as_ref().unwrap();
    let ready = shared.readiness(apps[0].now());
    assert_eq!(ready["redis_reachable"], false, "{ready}");
    assert!(ready["unpushed_events"].as_u64().unwrap() >= 140, "{ready}");
    let mut metrics = String::new();
    shared.render_metrics(&mut metrics);
    assert!(metrics.contains("equiroute_state_redis_up 0"), "{metrics}");
    assert!(
        !metrics.contains("equiroute_state_sync_errors_total 0\n"),
        "{metrics}"
    );
    // The local state already holds the local observations.
    let local = live_state(&apps[0]);
    let heads = |v: &Value| -> u64 {
        v["quality"]["heads"]["heads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["count"].as_u64().unwrap())
            .sum()
    };
    assert!(heads(&local) >= 70 + 30);

    // Redis returns (same port, same data directory): the backlog is pushed once.
    redis.spawn();
    for _ in 0..2 {
        for (s, a) in syncers.iter_mut().zip(&apps) {
            s.tick(a).await;
        }
    }
    assert!(apps[0]
        .shared
        .as_ref()
        .unwrap()
        .status
        .connected
        .load(std::sync::atomic::Ordering::Relaxed));
    // A batch sent again after a lost acknowledgement is not appended twice.
    syncers[0].resend_last_batch();
    for (s, a) in syncers.iter_mut().zip(&apps) {
        s.sync_once(a).await.unwrap();
    }
    let total_quality = all
        .iter()
        .filter(|o| matches!(o, Observation::Quality { .. }))
        .count() as u64;
    let total_attempts = all.len() as u64 - total_quality;
    for (i, a) in apps.iter().enumerate() {
        let v = live_state(a);
        assert_eq!(heads(&v), total_quality, "instance {i}: quality scores");
        let sum = |arr: &Value| -> u64 {
            arr.as_array()
                .unwrap()
                .iter()
                .map(|x| x["count"].as_u64().unwrap())
                .sum()
        };
        assert_eq!(
            sum(&v["risk"]["failures"]),
            total_attempts,
            "instance {i}: attempts"
        );
    }
    assert_close(
        &live_state(&apps[0]),
        &live_state(&apps[1]),
        "instances agree",
    );
}

#[tokio::test]
async fn breaker_openings_pending_contexts_and_feedback_reach_the_other_instances() {
    let Some(redis) = RedisServer::start("events") else {
        return;
    };
    let text = config(Some(&redis.url()), "events");
    let a = app(&text, 21);
    let b = app(&text, 22);
    let mut sa = Syncer::start(&redis_cfg(&text), &a).await.unwrap();
    let mut sb = Syncer::start(&redis_cfg(&text), &b).await.unwrap();
    let iface_a = a.interfaces()["chat"].clone();
    // A provider answers 429 with Retry-After: 30 s on instance A.
    let mut limited = AttemptOutcome::with_status(
        5.0,
        AttemptStatus::ProviderError(ProviderFailure::RateLimited),
    );
    limited.retry_after = Some(Millis(30_000.0));
    a.record_attempt(&iface_a, 1, &[1.0; 16], SlicePath::root(), &limited, None)
        .unwrap();
    let open_until = match iface_a.breakers.lock().unwrap()[1].state {
        equiroute_core::breaker::BreakerState::Open { until } => until,
        s => panic!("A's breaker is {s:?}"),
    };
    // An answered request on A waits for feedback.
    a.remember(
        "req-1",
        equiroute_gateway::server::state::PendingContext {
            interface: "chat",
            candidate: 2,
            features: equiroute_gateway::server::state::Features::F32(&[0.5; 16]),
            latency: Millis(12.0),
            at: a.now(),
            owner: None,
        },
    );
    sa.sync_once(&a).await.unwrap();
    sb.sync_once(&b).await.unwrap();
    // B's breaker is open until the same time, without B ever calling the provider.
    let b_state = b.interfaces()["chat"].breakers.lock().unwrap()[1].state;
    assert_eq!(
        b_state,
        equiroute_core::breaker::BreakerState::Open { until: open_until }
    );
    // Feedback for A's request, posted to B, is accepted there and counted once everywhere.
    assert_eq!(
        equiroute_gateway::server::feedback::apply(&b, "req-1", 0.9)
            .await
            .unwrap(),
        equiroute_gateway::server::feedback::Applied::Accepted
    );
    sb.sync_once(&b).await.unwrap();
    sa.sync_once(&a).await.unwrap();
    assert_eq!(
        equiroute_gateway::server::feedback::apply(&a, "req-1", 0.9)
            .await
            .unwrap(),
        equiroute_gateway::server::feedback::Applied::Duplicate
    );
    for s in [&a, &b] {
        let v = live_state(s);
        assert_eq!(v["quality"]["heads"]["heads"][2]["count"], 1);
    }
}

#[tokio::test]
async fn a_namespace_of_another_configuration_is_refused_with_the_way_out() {
    let Some(redis) = RedisServer::start("mismatch") else {
        return;
    };
    let text = config(Some(&redis.url()), "mm");
    let a = app(&text, 1);
    Syncer::start(&redis_cfg(&text), &a).await.unwrap();
    let other = text.replace("id = \"c\"", "id = \"d\"");
    let b = app(&other, 2);
    let e = Syncer::start(&redis_cfg(&other), &b)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("state.namespace `mm`") && e.contains("--reset-state"),
        "{e}"
    );
    assert!(!e.contains("redis://"), "no URL in errors: {e}");
    // Features read from a different number of words do not mix; the default, written out,
    // is the configuration of an instance that does not name it (or predates the setting).
    let longer = text.replace(
        "feature_dim = 16",
        "feature_dim = 16\nfeature_max_words = 256",
    );
    let c = app(&longer, 3);
    assert!(Syncer::start(&redis_cfg(&longer), &c).await.is_err());
    let same = text.replace(
        "feature_dim = 16",
        "feature_dim = 16\nfeature_max_words = 128",
    );
    let d = app(&same, 4);
    Syncer::start(&redis_cfg(&same), &d).await.unwrap();
}

/// `serve --reset-state` with Redis while an instance of the namespace runs would do nothing
/// (the instance writes its learning back at its next sync): it is refused and deletes
/// nothing. Once that instance has stopped cleanly (it leaves the live set), the reset
/// deletes every key of the namespace.
#[tokio::test]
async fn a_reset_is_refused_while_an_instance_of_the_namespace_runs() {
    let Some(redis) = RedisServer::start("reset-live") else {
        return;
    };
    let text = config(Some(&redis.url()), "rl");
    let cfg = redis_cfg(&text);
    let a = std::sync::Arc::new(app(&text, 1));
    let mut sa = Syncer::start(&cfg, a.as_ref()).await.unwrap();
    feed(&a, &workload(20));
    sa.sync_once(a.as_ref()).await.unwrap();
    let keys = || {
        let mut k = redis.strings("KEYS *");
        k.sort();
        k
    };
    let before = keys();
    assert!(before.contains(&"{rl}:log".to_owned()), "{before:?}");
    let e = equiroute_gateway::shared::reset(&cfg)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("1 instance(s) of this namespace are running")
            && e.contains(
                "stop every instance of the namespace, then start one with `--reset-state`"
            ),
        "{e}"
    );
    assert_eq!(keys(), before, "a refused reset deletes nothing");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let target: std::sync::Arc<dyn equiroute_gateway::shared::SyncTarget> = a.clone();
    let run = tokio::spawn(sa.run(target, stopped));
    stop.send(true).unwrap();
    run.await.unwrap();
    equiroute_gateway::shared::reset(&cfg).await.unwrap();
    assert_eq!(keys(), Vec::<String>::new(), "the namespace is gone");
}

#[tokio::test]
async fn an_instance_that_joins_late_starts_from_the_compacted_snapshot() {
    let Some(redis) = RedisServer::start("compact") else {
        return;
    };
    let text = config(Some(&redis.url()), "compact").replace(
        "sync_interval_ms = 50",
        "sync_interval_ms = 50\ncompact_every = 100",
    );
    let a = app(&text, 1);
    let mut sa = Syncer::start(&redis_cfg(&text), &a).await.unwrap();
    let all = workload(900);
    // 9 batches of 100 observations, each its own log entry.
    let mut compactions = 0;
    for chunk in all.chunks(100) {
        feed(&a, chunk);
        if sa.sync_once(&a).await.unwrap().compacted {
            compactions += 1;
        }
    }
    // Compaction is by entries: one entry per push here, so it needs more pushes.
    for chunk in all.chunks(3) {
        feed(&a, chunk);
        if sa.sync_once(&a).await.unwrap().compacted {
            compactions += 1;
        }
    }
    assert!(compactions >= 2, "compactions: {compactions}");
    let b = app(&text, 2);
    let mut sb = Syncer::start(&redis_cfg(&text), &b).await.unwrap();
    let report = sb.sync_once(&b).await.unwrap();
    assert!(report.loaded_snapshot, "{report:?}");
    assert_close(&live_state(&b), &live_state(&a), "late joiner");
}

#[tokio::test]
async fn acknowledgements_of_departed_instances_are_dropped_at_compaction() {
    let Some(redis) = RedisServer::start("acks") else {
        return;
    };
    let text = config(Some(&redis.url()), "acks").replace(
        "sync_interval_ms = 50",
        "sync_interval_ms = 50\ncompact_every = 100",
    );
    let a = app(&text, 1);
    let mut sa = Syncer::start(&redis_cfg(&text), &a).await.unwrap();
    let all = workload(400);
    feed(&a, &all[..3]);
    sa.sync_once(&a).await.unwrap();
    // This instance's acknowledgement: its batch number and Redis's time.
    let own = redis.strings(&format!("HGET {{acks}}:acks {}", sa.instance()));
    assert!(own.len() == 1 && own[0].contains(':'), "{own:?}");
    // Two departed instances: one that last appended long ago, one written before the
    // time was kept; and one that appended just now.
    redis.command("HSET {acks}:acks departed 7:1000");
    redis.command("HSET {acks}:acks unversioned 5");
    redis.command("HSET {acks}:acks recent 9:99999999999");
    let mut compacted = false;
    for chunk in all[3..].chunks(3) {
        feed(&a, chunk);
        compacted |= sa.sync_once(&a).await.unwrap().compacted;
    }
    assert!(compacted, "no compaction");
    let mut fields = redis.strings("HKEYS {acks}:acks");
    fields.sort();
    let mut kept = vec!["recent".to_owned(), sa.instance().to_owned()];
    kept.sort();
    assert_eq!(fields, kept, "the departed instances' fields are dropped");
    // The acknowledgement still guards a resent batch: appended once.
    let before = resp_int(&redis.command("XLEN {acks}:log"));
    sa.resend_last_batch();
    sa.sync_once(&a).await.unwrap();
    assert_eq!(resp_int(&redis.command("XLEN {acks}:log")), before);
}

/// The integer of a RESP reply line (`:123`), 0 for a nil.
fn resp_int(line: &str) -> u64 {
    line.trim_start_matches(':').parse().unwrap_or(0)
}

#[tokio::test]
async fn the_log_is_compacted_by_its_bytes_so_redis_memory_stays_bounded() {
    let Some(redis) = RedisServer::start("compact-bytes") else {
        return;
    };
    // Busy instances write big entries (each carries a batch of observations and request
    // contexts): counted in entries alone, the default of 20,000 would let the log grow for
    // hours. Here the entry count never triggers; the bytes must.
    let bound = 65_536_u64;
    let text = config(Some(&redis.url()), "bytes").replace(
        "sync_interval_ms = 50",
        &format!("sync_interval_ms = 50\ncompact_every = 1000000\ncompact_bytes = {bound}"),
    );
    let a = app(&text, 1);
    let mut sa = Syncer::start(&redis_cfg(&text), &a).await.unwrap();
    let (mut compactions, mut largest_log, mut largest_entry) = (0, 0_u64, 0_u64);
    let mut entries = 0_u64;
    for chunk in workload(3000).chunks(40) {
        let before = resp_int(&redis.command("MEMORY USAGE {bytes}:log SAMPLES 0"));
        feed(&a, chunk);
        if sa.sync_once(&a).await.unwrap().compacted {
            compactions += 1;
        }
        entries += 1;
        let log = resp_int(&redis.command("MEMORY USAGE {bytes}:log SAMPLES 0"));
        largest_entry = largest_entry.max(log.saturating_sub(before));
        largest_log = largest_log.max(log);
    }
    let len = resp_int(&redis.command("XLEN {bytes}:log"));
    assert!(
        compactions >= 3,
        "compactions: {compactions} of {entries} entries"
    );
    assert!(
        len < entries / 2,
        "the log holds {len} of {entries} entries"
    );
    // The entries since the previous snapshot are kept: at most twice the bound plus the
    // entry that crossed it, in payload; Redis's stream encoding (entry ids, listpack and
    // radix-tree nodes) adds a few percent (7% here).
    assert!(
        largest_log * 100 <= 115 * (2 * bound + largest_entry),
        "the log reached {largest_log} bytes (bound {bound}, largest entry {largest_entry})"
    );
    let b = app(&text, 2);
    let mut sb = Syncer::start(&redis_cfg(&text), &b).await.unwrap();
    assert!(sb.sync_once(&b).await.unwrap().loaded_snapshot);
    assert_close(&live_state(&b), &live_state(&a), "late joiner");
}

/// Sum of `equiroute_attempts_total` in a metrics exposition.
fn attempts_in(metrics: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("equiroute_attempts_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// The attempts both gateways' `/metrics` count in all, the failures' counts each one's
/// learning state holds, and what is wrong with either's view of Redis (empty when each sees
/// it again and saw the outage).
async fn totals_and_counts(gateways: &[common::Gateway]) -> (u64, Vec<u64>, Vec<String>) {
    let mut total = 0;
    let mut counted = Vec::new();
    let mut wrong = Vec::new();
    for g in gateways {
        let m = common::http(g.addr, "GET", "/metrics", &[], "").await.body;
        if !m.contains("equiroute_state_redis_up 1") {
            wrong.push(format!("Redis is not up again: {m}"));
        }
        if m.contains("equiroute_state_sync_errors_total 0\n") {
            wrong.push(format!("the outage was not seen: {m}"));
        }
        total += attempts_in(&m);
        let s = common::http(
            g.addr,
            "GET",
            "/v1/interfaces/chat/state?full=true",
            &[],
            "",
        )
        .await
        .json();
        let n: u64 = s["learning_state"]["risk"]["failures"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["count"].as_u64().unwrap())
            .sum();
        counted.push(n);
        let ready = common::http(g.addr, "GET", "/readyz", &[], "").await.json();
        if ready["state"]["redis_reachable"] != true {
            wrong.push(format!("not ready with Redis: {ready}"));
        }
    }
    (total, counted, wrong)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_under_load_keep_exact_totals_across_a_redis_restart() {
    let Some(mut redis) = RedisServer::start("load") else {
        return;
    };
    // One attempt in five fails. With the default breakers (open for 30 s after 5 failures
    // in a row, or half of the last 20) that alone opens at least one of the three in about
    // a quarter of runs, and all three in about 0.3% (a Monte Carlo of this loop, with the
    // candidates in random order), which refuses every later request: this test is about
    // totals, so the breakers here open only after 20 failures in a row.
    let text = config(Some(&redis.url()), "load")
        .replace(
            "sim = { latency = { p50_ms = 2, p95_ms = 4 } }",
            "sim = { latency = { p50_ms = 2, p95_ms = 4 }, failure_rate = 0.2 }",
        )
        .replace(
            "kind = \"chat\"\n",
            "kind = \"chat\"\nbreaker = { consecutive_failures = 20, failure_rate = 1.0, min_attempts = 20 }\n",
        );
    assert!(text.contains("breaker = "), "{text}");
    let gateways = [
        common::start(&text, &[]).await,
        common::start(&text, &[]).await,
    ];
    let body = r#"{"model":"chat","messages":[{"role":"user","content":"how far is the moon"}]}"#;
    let mut answered = 0;
    // Each answer that is not a 200, by round, for the message if too few are answered.
    let mut refused: Vec<String> = Vec::new();
    for round in 0..240 {
        if round == 80 {
            redis.kill();
        }
        if round == 160 {
            redis.spawn();
        }
        let g = &gateways[round % 2];
        let r = common::http(g.addr, "POST", "/v1/chat/completions", &[], body).await;
        if r.status == 200 {
            answered += 1;
        } else {
            refused.push(format!("round {round}: {} {}", r.status, r.body));
        }
        if round % 20 == 0 {
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    assert!(
        answered > 200,
        "answered {answered}; the others:\n{}",
        refused.join("\n")
    );
    // Each instance syncs every 50 ms, but after a Redis restart on a loaded machine the
    // last batches can take longer than a few intervals: read until both instances hold
    // every attempt, for at most 15 s, then judge the last reading.
    let deadline = Instant::now() + Duration::from_secs(15);
    let (total, counted, wrong) = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let reading = totals_and_counts(&gateways).await;
        let exact = reading.1 == [reading.0, reading.0] && reading.2.is_empty();
        if exact || Instant::now() > deadline {
            break reading;
        }
    };
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(total >= 240);
    assert_eq!(
        counted,
        vec![total, total],
        "each instance counts every attempt of both once"
    );
}

/// Quality scores counted per candidate, in an exported state.
fn quality_counts(v: &Value) -> Vec<u64> {
    v["quality"]["heads"]["heads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["count"].as_u64().unwrap())
        .collect()
}

/// An answered request on `app`, served by `candidate`, waiting for feedback.
fn answered(app: &AppState, id: &str, candidate: usize) {
    app.remember(
        id,
        equiroute_gateway::server::state::PendingContext {
            interface: "chat",
            candidate,
            features: equiroute_gateway::server::state::Features::F32(&[0.25; 16]),
            latency: Millis(10.0),
            at: app.now(),
            owner: None,
        },
    );
}

fn status_of(
    r: &Result<equiroute_gateway::server::feedback::Applied, impl std::fmt::Debug>,
) -> &'static str {
    match r {
        Ok(equiroute_gateway::server::feedback::Applied::Accepted) => "accepted",
        Ok(equiroute_gateway::server::feedback::Applied::Duplicate) => "duplicate",
        Err(_) => "error",
    }
}

#[tokio::test]
async fn feedback_posted_to_two_instances_counts_once_even_without_redis() {
    let Some(mut redis) = RedisServer::start("feedback") else {
        return;
    };
    // A claim waits up to a second here: this test is about who wins, not about timing.
    let text = config(Some(&redis.url()), "feedback").replace(
        "sync_interval_ms = 50",
        "sync_interval_ms = 50\nclaim_timeout_ms = 1000",
    );
    let a = app(&text, 31);
    let b = app(&text, 32);
    let mut sa = Syncer::start(&redis_cfg(&text), &a).await.unwrap();
    let mut sb = Syncer::start(&redis_cfg(&text), &b).await.unwrap();
    // Three requests answered on A, each by another candidate; B learns their contexts.
    for (id, candidate) in [("req-con", 0), ("req-seq", 1), ("req-out", 2)] {
        answered(&a, id, candidate);
    }
    sa.sync_once(&a).await.unwrap();
    sb.sync_once(&b).await.unwrap();
    let apply = equiroute_gateway::server::feedback::apply;

    // 1. Posted to both at once: one accepted, one duplicate.
    let (ra, rb) = tokio::join!(apply(&a, "req-con", 0.9), apply(&b, "req-con", 0.2));
    let mut got = [status_of(&ra), status_of(&rb)];
    got.sort_unstable();
    assert_eq!(got, ["accepted", "duplicate"], "concurrent: {ra:?} {rb:?}");
    // 2. Posted to A, then to B before any sync.
    assert_eq!(status_of(&apply(&a, "req-seq", 0.7).await), "accepted");
    assert_eq!(status_of(&apply(&b, "req-seq", 0.7).await), "duplicate");
    for _ in 0..2 {
        sa.sync_once(&a).await.unwrap();
        sb.sync_once(&b).await.unwrap();
    }
    for (name, s, syncer) in [("A", &a, &sa), ("B", &b, &sb)] {
        assert_eq!(quality_counts(&live_state(s)), [1, 1, 0], "{name} live");
        let confirmed = serde_json::to_value(&syncer.confirmed_states()["chat"]).unwrap();
        assert_eq!(quality_counts(&confirmed), [1, 1, 0], "{name} confirmed");
    }

    // 3. Redis down: both instances accept the score on their own...
    redis.kill();
    assert_eq!(status_of(&apply(&a, "req-out", 0.8).await), "accepted");
    assert_eq!(status_of(&apply(&b, "req-out", 0.3).await), "accepted");
    sa.tick(&a).await;
    sb.tick(&b).await;
    assert_eq!(quality_counts(&live_state(&a)), [1, 1, 1]);
    // ...and when Redis returns the stream counts it once, everywhere.
    redis.spawn();
    for _ in 0..2 {
        sa.tick(&a).await;
        sb.tick(&b).await;
    }
    for (name, s, syncer) in [("A", &a, &sa), ("B", &b, &sb)] {
        let shared = s.shared.as_ref().unwrap();
        assert!(shared
            .status
            .connected
            .load(std::sync::atomic::Ordering::Relaxed));
        assert_eq!(quality_counts(&live_state(s)), [1, 1, 1], "{name} live");
        let confirmed = serde_json::to_value(&syncer.confirmed_states()["chat"]).unwrap();
        assert_eq!(quality_counts(&confirmed), [1, 1, 1], "{name} confirmed");
        let mut metrics = String::new();
        shared.render_metrics(&mut metrics);
        assert!(
            metrics.contains("equiroute_state_duplicate_feedback_skipped_total 1\n"),
            "{name}: {metrics}"
        );
    }
    assert_close(&live_state(&a), &live_state(&b), "instances agree");
    // The first score in the stream is the one that counts, on both: the same b vector.
    let later = app(&text, 33);
    let mut sl = Syncer::start(&redis_cfg(&text), &later).await.unwrap();
    sl.sync_once(&later).await.unwrap();
    assert_close(
        &live_state(&later),
        &live_state(&a),
        "a new instance agrees",
    );
}

#[tokio::test]
async fn a_redis_that_lost_the_stream_is_reseeded_from_the_instances() {
    let Some(redis) = RedisServer::start("flushed") else {
        return;
    };
    let text = config(Some(&redis.url()), "flushed");
    let a = app(&text, 41);
    let b = app(&text, 42);
    let mut sa = Syncer::start(&redis_cfg(&text), &a).await.unwrap();
    let mut sb = Syncer::start(&redis_cfg(&text), &b).await.unwrap();
    let all = workload(300);
    feed(&a, &all[..100]);
    feed(&b, &all[100..200]);
    sa.sync_once(&a).await.unwrap();
    sb.sync_once(&b).await.unwrap();
    sa.sync_once(&a).await.unwrap();
    assert_close(&live_state(&a), &live_state(&b), "synced before the loss");
    // Redis loses everything (as a restart without persistence would); both go on.
    assert_eq!(redis.command("FLUSHALL"), "+OK");
    feed(&a, &all[200..250]);
    feed(&b, &all[250..]);
    let ra = sa.sync_once(&a).await.unwrap();
    let rb = sb.sync_once(&b).await.unwrap();
    sa.sync_once(&a).await.unwrap();
    // A new instance starts from everything A and B learnt, not from the backlog alone.
    let c = app(&text, 43);
    let mut sc = Syncer::start(&redis_cfg(&text), &c).await.unwrap();
    let rc = sc.sync_once(&c).await.unwrap();
    let total_quality = all
        .iter()
        .filter(|o| matches!(o, Observation::Quality { .. }))
        .count() as u64;
    let total_attempts = all.len() as u64 - total_quality;
    for (name, s) in [("A", &a), ("B", &b), ("C", &c)] {
        let v = live_state(s);
        assert_eq!(
            quality_counts(&v).iter().sum::<u64>(),
            total_quality,
            "{name}: quality scores"
        );
        let attempts: u64 = v["risk"]["failures"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["count"].as_u64().unwrap())
            .sum();
        assert_eq!(attempts, total_attempts, "{name}: attempts");
    }
    assert_close(&live_state(&b), &live_state(&a), "B");
    assert_close(&live_state(&c), &live_state(&a), "C");
    assert!(ra.reseeded && !ra.rebased, "A noticed first: {ra:?}");
    assert!(rb.rebased && !rb.reseeded, "B re-based on A's: {rb:?}");
    assert!(rc.loaded_snapshot && !rc.reseeded, "{rc:?}");
    for s in [&a, &b] {
        let mut metrics = String::new();
        s.shared.as_ref().unwrap().render_metrics(&mut metrics);
        assert!(
            metrics.contains("equiroute_state_recoveries_total 1\n"),
            "{metrics}"
        );
    }
}

/// p50 and p99 of `samples` (µs).
fn percentiles(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// A measurement, not a check: the latency `POST /v1/feedback` gains from its claim in Redis.
/// `cargo test -p equiroute-gateway --test shared feedback_latency -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn feedback_latency_with_and_without_the_claim() {
    let Some(redis) = RedisServer::start("latency") else {
        return;
    };
    let n = 1000;
    // The claim alone, as the request path makes it.
    let text = config(Some(&redis.url()), "latency");
    let a = app(&text, 51);
    let _sa = Syncer::start(&redis_cfg(&text), &a).await.unwrap();
    let claims = &a.shared.as_ref().unwrap().claims;
    let mut alone = Vec::with_capacity(n);
    let mut won = 0;
    for i in 0..n {
        let started = Instant::now();
        let c = claims
            .claim(&format!("req-lat-{i}"), Millis(60_000.0))
            .await;
        alone.push(started.elapsed().as_secs_f64() * 1e6);
        won += usize::from(c == equiroute_gateway::shared::Claim::Won);
    }
    // The others found no answer within claim_timeout_ms (20 ms): a loaded machine.
    assert!(won > n / 2, "won {won} of {n}");
    // feedback::apply, the claim included.
    let mut applied = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("req-apply-{i}");
        answered(&a, &id, i % 3);
        let started = Instant::now();
        equiroute_gateway::server::feedback::apply(&a, &id, 0.5)
            .await
            .unwrap();
        applied.push(started.elapsed().as_secs_f64() * 1e6);
    }
    let applied = percentiles(applied);
    // The whole route, on a gateway sharing state through Redis and on one that does not,
    // in turns (so that the machine's load weighs on both alike).
    let body = r#"{"model":"chat","messages":[{"role":"user","content":"how far is the moon"}]}"#;
    let gateways = [
        common::start(&config(None, ""), &[]).await,
        common::start(&config(Some(&redis.url()), "latency-http"), &[]).await,
    ];
    let mut took = [Vec::with_capacity(n), Vec::with_capacity(n)];
    let mut chat = [Vec::with_capacity(n), Vec::with_capacity(n)];
    for _ in 0..n {
        for ((g, took), chat) in gateways.iter().zip(&mut took).zip(&mut chat) {
            let started = Instant::now();
            let r = common::http(g.addr, "POST", "/v1/chat/completions", &[], body).await;
            chat.push(started.elapsed().as_secs_f64() * 1e6);
            assert_eq!(r.status, 200, "{}", r.body);
            let id = r.header("x-equiroute-request-id").unwrap().to_owned();
            let fb = format!(r#"{{"request_id":"{id}","quality":0.5}}"#);
            let started = Instant::now();
            let r = common::http(g.addr, "POST", "/v1/feedback", &[], &fb).await;
            took.push(started.elapsed().as_secs_f64() * 1e6);
            assert_eq!(r.json()["status"], "accepted", "{}", r.body);
        }
    }
    let routes = took.map(percentiles);
    let chat = chat.map(percentiles);
    let (p50, p99) = percentiles(alone);
    println!("claim alone (SET NX PX on loopback), {n} calls: p50 {p50:.0} µs, p99 {p99:.0} µs, {won} won, the others timed out");
    println!(
        "feedback::apply with the claim, {n} calls: p50 {:.0} µs, p99 {:.0} µs",
        applied.0, applied.1
    );
    println!(
        "POST /v1/feedback, {n} calls, a new connection each: without Redis p50 {:.0} µs p99 {:.0} µs; with the claim p50 {:.0} µs p99 {:.0} µs",
        routes[0].0, routes[0].1, routes[1].0, routes[1].1
    );
    println!(
        "POST /v1/chat/completions (sim provider, 2 ms p50), for comparison: without Redis p50 {:.0} µs p99 {:.0} µs; with Redis p50 {:.0} µs p99 {:.0} µs",
        chat[0].0, chat[0].1, chat[1].0, chat[1].1
    );
}

/// `config` with a shadow `lqm` beside the live `lqm-ts`.
fn with_shadow(text: &str) -> String {
    text.replace("feature_dim = 16\n", "feature_dim = 16\nshadow = \"lqm\"\n")
}

/// `config` compacting every 64 KiB of entries (the least allowed).
fn compacting(text: &str) -> String {
    text.replace(
        "sync_interval_ms = 50",
        "sync_interval_ms = 50\ncompact_every = 100\ncompact_bytes = 65536",
    )
}

fn shadow_state(app: &AppState) -> Value {
    let chat = app.interface("chat").unwrap();
    let shadow = chat.arms.shadow.as_ref().unwrap();
    let state = shadow.policy.write().unwrap().export_state();
    serde_json::to_value(state).unwrap()
}

#[tokio::test]
async fn shadows_learn_every_instances_observations_through_the_stream_and_snapshots() {
    let Some(redis) = RedisServer::start("shadow") else {
        return;
    };
    let text = with_shadow(&compacting(&config(Some(&redis.url()), "shadow")));
    let (a, b, mut sa, mut sb) = two_instances(&text).await;
    let all = workload(400);
    // A learns the first half in small pushes (compacting on the way), B the second; each
    // pulls what the other pushed.
    let (first, second) = all.split_at(200);
    for chunk in first.chunks(20) {
        feed(&a, chunk);
        sa.sync_once(&a).await.unwrap();
    }
    let empty_shadow = shadow_state(&app(&with_shadow(&config(None, "")), 9));
    assert_ne!(shadow_state(&a), empty_shadow, "A's shadow learnt");
    sb.sync_once(&b).await.unwrap();
    // B's shadow never saw a request of its own, and holds A's observations.
    assert_close(
        &shadow_state(&b),
        &shadow_state(&a),
        "B's shadow after a sync",
    );
    feed(&b, second);
    sb.sync_once(&b).await.unwrap();
    sa.sync_once(&a).await.unwrap();
    // Both hold the shadow of one instance that saw everything in the stream's order.
    let single = app(&with_shadow(&config(None, "")), 9);
    feed(&single, first);
    feed(&single, second);
    let expected = shadow_state(&single);
    assert_close(&shadow_state(&a), &expected, "A's shadow");
    assert_close(&shadow_state(&b), &expected, "B's shadow");
    let confirmed = serde_json::to_value(&sa.confirmed_states()["chat/shadow"]).unwrap();
    assert_close(&confirmed, &expected, "A's confirmed shadow");
    // A late joiner starts from the compacted snapshot, which carries the shadow.
    let mut compactions = 0;
    for chunk in workload(2000).chunks(40) {
        feed(&a, chunk);
        compactions += usize::from(sa.sync_once(&a).await.unwrap().compacted);
    }
    assert!(compactions >= 2, "{compactions}");
    let c = app(&text, 3);
    let mut sc = Syncer::start(&redis_cfg(&text), &c).await.unwrap();
    let report = sc.sync_once(&c).await.unwrap();
    assert!(report.loaded_snapshot, "{report:?}");
    assert_close(&shadow_state(&c), &shadow_state(&a), "late joiner's shadow");
    assert_close(
        &live_state(&c),
        &live_state(&a),
        "late joiner's live policy",
    );
}

#[tokio::test]
async fn a_snapshot_without_shadow_state_still_loads_and_the_shadow_learns_after_it() {
    let Some(redis) = RedisServer::start("noshadow") else {
        return;
    };
    // An instance without a shadow writes snapshots as earlier releases did: no shadow key.
    let plain = compacting(&config(Some(&redis.url()), "noshadow"));
    let w = app(&plain, 1);
    let mut sw = Syncer::start(&redis_cfg(&plain), &w).await.unwrap();
    let all = workload(2400);
    let (before, after) = all.split_at(2000);
    let mut compactions = 0;
    for chunk in before.chunks(40) {
        feed(&w, chunk);
        compactions += usize::from(sw.sync_once(&w).await.unwrap().compacted);
    }
    assert!(compactions >= 2, "{compactions}");
    assert!(!sw.confirmed_states().contains_key("chat/shadow"));
    let text = with_shadow(&plain);
    let d = app(&text, 2);
    let mut sd = Syncer::start(&redis_cfg(&text), &d).await.unwrap();
    let report = sd.sync_once(&d).await.unwrap();
    assert!(report.loaded_snapshot, "{report:?}");
    assert_close(
        &live_state(&d),
        &live_state(&w),
        "live policy from the snapshot",
    );
    // The shadow starts empty at the snapshot and learns what follows it in the stream:
    // what the snapshot's instance learnt after its last snapshot, then the rest.
    feed(&w, after);
    sw.sync_once(&w).await.unwrap();
    sd.sync_once(&d).await.unwrap();
    let shadow = shadow_state(&d);
    let fresh = app(&with_shadow(&config(None, "")), 9);
    let empty = shadow_state(&fresh);
    assert_ne!(shadow, empty, "the shadow learnt from the stream");
    // Of the 1200 quality scores, the live policy holds all; the shadow at least the last
    // 200, and not those before the snapshot.
    let learnt: u64 = shadow["heads"]["heads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["count"].as_u64().unwrap())
        .sum();
    let live: u64 = quality_counts(&live_state(&d)).iter().sum();
    assert_eq!(live, 1200);
    assert!((200..1200).contains(&learnt), "{learnt}");
    assert_close(
        &live_state(&d),
        &live_state(&w),
        "live policy after the stream",
    );
}

fn rollout_state(app: &AppState) -> Value {
    let chat = app.interface("chat").unwrap();
    let rollout = chat.arms.rollout.as_ref().unwrap();
    let state = rollout.policy.write().unwrap().export_state();
    serde_json::to_value(state).unwrap()
}

#[tokio::test]
async fn a_rollouts_candidate_learns_every_instances_canary_requests_and_the_live_policy_does_not()
{
    let Some(redis) = RedisServer::start("rollout") else {
        return;
    };
    let text = compacting(&config(Some(&redis.url()), "rollout")).replace(
        "feature_dim = 16\n",
        "feature_dim = 16\nrollout = { policy = \"lqm\", percent = 50 }\n",
    );
    let (a, b, mut sa, mut sb) = two_instances(&text).await;
    let empty = (rollout_state(&b), live_state(&b));
    // Attempts of requests the candidate routed on A, and the live arm's on B.
    let iface = a.interfaces()["chat"].clone();
    let mut canary = 0;
    for o in workload(2000) {
        if !route_to_candidate(&a, o) {
            continue;
        }
        canary += 1;
        if canary % 40 == 0 {
            sa.sync_once(&a).await.unwrap();
        }
    }
    // And the quality scores of canary requests A routed.
    let scores = |v: &Value| -> u64 {
        v["heads"]["heads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h["count"].as_u64().unwrap())
            .sum()
    };
    sa.sync_once(&a).await.unwrap();
    let learnt = scores(&rollout_state(&a));
    let arms = equiroute_gateway::server::arms::Arm::Candidate;
    for k in 0..20_usize {
        let id = format!("canary-{k}");
        let routed = equiroute_gateway::server::arms::Routed {
            arm: arms,
            n: k as u64,
            policy: "lqm",
        };
        let done = equiroute_core::executor::RequestStatus::Succeeded { candidate: k % 3 };
        equiroute_gateway::server::arms::finish(&iface, &id, routed, done, 1.7e12);
        let features = vec![1.0; 16];
        let obs = equiroute_core::policies::QualityObservation {
            candidate: k % 3,
            features: &features,
            quality: 0.9,
            latency: Millis(50.0),
            now: Timestamp(1.7e12 + k as f64),
        };
        a.record_quality(&iface, &id, &obs).unwrap();
    }
    sa.sync_once(&a).await.unwrap();
    assert_eq!(
        scores(&rollout_state(&a)),
        learnt + 20,
        "A's candidate learnt the scores"
    );
    assert_ne!(rollout_state(&a), empty.0, "A's candidate learnt");
    assert_close(
        &live_state(&a),
        &empty.1,
        "A's live policy learnt none of them",
    );
    feed(&b, &workload(60));
    sb.sync_once(&b).await.unwrap();
    assert_close(
        &rollout_state(&b),
        &rollout_state(&a),
        "B's candidate after a sync",
    );
    assert_eq!(
        scores(&rollout_state(&b)),
        learnt + 20,
        "B's candidate has A's canary scores"
    );
    sa.sync_once(&a).await.unwrap();
    assert_close(&live_state(&a), &live_state(&b), "the live policies");
    // A late joiner starts from the compacted snapshot, which carries the candidate.
    let c = app(&text, 3);
    let mut sc = Syncer::start(&redis_cfg(&text), &c).await.unwrap();
    let report = sc.sync_once(&c).await.unwrap();
    assert!(report.loaded_snapshot, "{report:?}");
    assert_close(
        &rollout_state(&c),
        &rollout_state(&a),
        "late joiner's candidate",
    );
}

/// `config` with a canary of `lqm` on half of the requests, whose guard is tuned for a
/// rollback within a few dozen requests.
fn with_canary(text: &str) -> String {
    text.replace(
        "feature_dim = 16\n",
        "feature_dim = 16\nrollout = { policy = \"lqm\", percent = 50, guard = { tuned_for = 20 } }\n",
    )
}

fn rollout_report(app: &AppState) -> Value {
    app.interfaces()["chat"]
        .arms
        .rollout
        .as_ref()
        .unwrap()
        .report()
}

/// The value of the `/metrics` sample starting with `key` (labels included).
fn arms_metric(app: &AppState, key: &str) -> f64 {
    let mut out = String::new();
    equiroute_gateway::server::arms::render_metrics(&**app.interfaces(), &mut out);
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no `{key}` in:\n{out}"))
}

const ACTIVE: &str = "equiroute_rollout_active{interface=\"chat\"} ";
const ROLLBACKS: &str =
    "equiroute_rollout_events_total{interface=\"chat\",event=\"rollback_bad_rate\"} ";
const ROLLBACKS_RECEIVED: &str =
    "equiroute_rollout_events_received_total{interface=\"chat\",event=\"rollback_bad_rate\"} ";

/// Finishes requests on `app`, every canary one failed and every live one answered, until
/// its guard rolls the canary back.
fn roll_back(app: &AppState) {
    use equiroute_core::executor::RequestStatus;
    use equiroute_gateway::server::arms::{Arm, Routed};
    let iface = app.interfaces()["chat"].clone();
    let mut n = 0_u64;
    while rollout_report(app)["status"]["state"] == "running" {
        assert!(n < 400, "the guard never fired: {}", rollout_report(app));
        let (arm, status) = if n.is_multiple_of(2) {
            (Arm::Candidate, RequestStatus::Exhausted)
        } else {
            (Arm::Live, RequestStatus::Succeeded { candidate: 0 })
        };
        let routed = Routed {
            arm,
            n,
            policy: "lqm",
        };
        app.finish_routed(&iface, &format!("r{n}"), routed, status);
        n += 1;
    }
}

#[tokio::test]
async fn a_canary_rolled_back_on_one_instance_is_rolled_back_on_every_instance_and_a_late_joiner() {
    let Some(redis) = RedisServer::start("rollback") else {
        return;
    };
    let text = with_canary(&compacting(&config(Some(&redis.url()), "rollback")));
    let (a, b, mut sa, mut sb) = two_instances(&text).await;
    // On A every canary request fails and every live one succeeds, until A's guard fires.
    roll_back(&a);
    let ra = rollout_report(&a);
    assert_eq!(ra["status"]["state"], "rolled_back", "{ra}");
    assert_eq!(ra["status"]["decided_by"], "this_instance", "{ra}");
    assert_eq!(rollout_report(&b)["status"]["state"], "running");
    assert!((arms_metric(&b, ACTIVE) - 1.0).abs() < 1e-12);
    // One sync interval: A pushes, B pulls.
    sa.sync_once(&a).await.unwrap();
    sb.sync_once(&b).await.unwrap();
    let rb = rollout_report(&b);
    assert_eq!(rb["status"]["state"], "rolled_back", "{rb}");
    assert_eq!(rb["status"]["decided_by"], "another_instance", "{rb}");
    assert_eq!(rb["status"]["metric"], ra["status"]["metric"]);
    assert_eq!(
        rb["status"]["evidence"], ra["status"]["evidence"],
        "B shows A's evidence"
    );
    assert!(arms_metric(&b, ACTIVE).abs() < 1e-12, "B's canary stopped");
    // Counted once where decided; received elsewhere.
    assert!((arms_metric(&a, ROLLBACKS) - 1.0).abs() < 1e-12);
    assert!(arms_metric(&a, ROLLBACKS_RECEIVED).abs() < 1e-12);
    assert!(arms_metric(&b, ROLLBACKS).abs() < 1e-12);
    assert!((arms_metric(&b, ROLLBACKS_RECEIVED) - 1.0).abs() < 1e-12);
    // A reads its own rollback back from the stream: nothing changes there.
    sa.sync_once(&a).await.unwrap();
    assert_eq!(rollout_report(&a), ra);
    assert!(arms_metric(&a, ROLLBACKS_RECEIVED).abs() < 1e-12);
    // A late joiner, after compactions trimmed the entry of the rollback: the snapshot has it.
    let mut compactions = 0;
    for chunk in workload(2000).chunks(40) {
        feed(&a, chunk);
        compactions += usize::from(sa.sync_once(&a).await.unwrap().compacted);
    }
    assert!(compactions >= 2, "{compactions}");
    let c = app(&text, 3);
    let mut sc = Syncer::start(&redis_cfg(&text), &c).await.unwrap();
    assert_eq!(rollout_report(&c)["status"]["state"], "running");
    let report = sc.sync_once(&c).await.unwrap();
    assert!(report.loaded_snapshot, "{report:?}");
    let rc = rollout_report(&c);
    assert_eq!(rc["status"]["state"], "rolled_back", "{rc}");
    assert_eq!(rc["status"]["evidence"], ra["status"]["evidence"]);
    assert!(
        arms_metric(&c, ACTIVE).abs() < 1e-12,
        "C's canary never runs"
    );
    // A snapshot of an earlier release has no `rollouts` field: it still loads, with no
    // rollout ended.
    assert_eq!(redis.command("HDEL {rollback}:snapshot rollouts"), ":1");
    let d = app(&text, 4);
    let mut sd = Syncer::start(&redis_cfg(&text), &d).await.unwrap();
    assert!(sd.sync_once(&d).await.unwrap().loaded_snapshot);
    assert_eq!(rollout_report(&d)["status"]["state"], "running");
    assert_close(&live_state(&d), &live_state(&a), "D's live policy");
}

#[tokio::test]
async fn a_promotion_on_one_instance_makes_the_candidate_every_instances_live_policy() {
    let Some(redis) = RedisServer::start("promote") else {
        return;
    };
    let text = with_canary(&compacting(&config(Some(&redis.url()), "promote")));
    let (a, b, mut sa, mut sb) = two_instances(&text).await;
    // A's canary learns from attempts it routed; B's live policy from its own traffic.
    let iface = a.interfaces()["chat"].clone();
    for o in workload(400) {
        route_to_candidate(&a, o);
    }
    feed(&b, &workload(60));
    sa.sync_once(&a).await.unwrap();
    sb.sync_once(&b).await.unwrap();
    sa.sync_once(&a).await.unwrap();
    assert_close(&rollout_state(&b), &rollout_state(&a), "the candidates");
    assert_eq!(b.interfaces()["chat"].policy_name(), "lqm-ts");
    let candidate = rollout_state(&a);
    assert_ne!(live_state(&a), candidate);
    // The operator promotes on A.
    a.end_rollout_by_operator(&iface, true).unwrap();
    assert_eq!(a.interfaces()["chat"].policy_name(), "lqm");
    assert_close(&live_state(&a), &candidate, "A's live policy");
    sa.sync_once(&a).await.unwrap();
    sb.sync_once(&b).await.unwrap();
    let rb = rollout_report(&b);
    assert_eq!(rb["status"]["state"], "promoted", "{rb}");
    assert_eq!(rb["status"]["decided_by"], "another_instance", "{rb}");
    assert_eq!(b.interfaces()["chat"].policy_name(), "lqm");
    assert_close(
        &live_state(&b),
        &candidate,
        "B's live policy is the candidate",
    );
    let received = "equiroute_rollout_events_received_total{interface=\"chat\",event=\"promote\"} ";
    assert!((arms_metric(&b, received) - 1.0).abs() < 1e-12);
    assert!(arms_metric(&b, ACTIVE).abs() < 1e-12);
    // From then on both instances' traffic teaches the promoted policy, the same on both.
    feed(&b, &workload(90)[60..]);
    feed(&a, &workload(120)[90..]);
    sb.sync_once(&b).await.unwrap();
    sa.sync_once(&a).await.unwrap();
    sb.sync_once(&b).await.unwrap();
    assert_ne!(live_state(&b), candidate, "the promoted policy learns");
    assert_close(
        &live_state(&a),
        &live_state(&b),
        "the promoted live policies",
    );
    // An instance that starts later replays the stream: promoted from the start.
    let c = app(&text, 3);
    let mut sc = Syncer::start(&redis_cfg(&text), &c).await.unwrap();
    sc.sync_once(&c).await.unwrap();
    assert_eq!(rollout_report(&c)["status"]["state"], "promoted");
    assert_eq!(c.interfaces()["chat"].policy_name(), "lqm");
    assert_close(
        &live_state(&c),
        &live_state(&a),
        "the late joiner's live policy",
    );
    // After compactions trimmed the promotion's entry, a late joiner starts from the snapshot:
    // promoted, its live policy the promoted one with what it learnt since.
    let mut compactions = 0;
    for chunk in workload(2000).chunks(40) {
        feed(&a, chunk);
        compactions += usize::from(sa.sync_once(&a).await.unwrap().compacted);
    }
    assert!(compactions >= 2, "{compactions}");
    let e = app(&text, 5);
    let mut se = Syncer::start(&redis_cfg(&text), &e).await.unwrap();
    assert!(se.sync_once(&e).await.unwrap().loaded_snapshot);
    assert_eq!(rollout_report(&e)["status"]["state"], "promoted");
    assert_eq!(e.interfaces()["chat"].policy_name(), "lqm");
    assert_close(
        &live_state(&e),
        &live_state(&a),
        "the joiner's promoted live policy",
    );
    // An instance without the rollout cannot follow the promotion: its sync says why.
    let plain = compacting(&config(Some(&redis.url()), "promote"));
    let d = app(&plain, 4);
    let mut sd = Syncer::start(&redis_cfg(&plain), &d).await.unwrap();
    let err = sd.sync_once(&d).await.unwrap_err().to_string();
    assert!(
        err.contains("interface `chat`") && err.contains("has no rollout"),
        "{err}"
    );
    // A promotion cannot be undone: a second end is refused with the rollout's state.
    let err = b
        .end_rollout_by_operator(&b.interfaces()["chat"], false)
        .unwrap_err();
    assert!(format!("{err:?}").contains("promoted"), "{err:?}");
}

/// The error with which an instance of configuration `text` fails to start its syncer.
async fn refused_at_start(text: &str, seed: u64) -> String {
    let instance = app(text, seed);
    Syncer::start(&redis_cfg(text), &instance)
        .await
        .unwrap_err()
        .to_string()
}

/// The interface's policy in `config`.
const LIVE_POLICY: &str = "policy = { name = \"lqm-ts\", lqm = { head = { window = 25 } } }";

#[tokio::test]
async fn after_a_promotion_instances_configured_with_the_promoted_policy_join_the_namespace() {
    let Some(redis) = RedisServer::start("adopt") else {
        return;
    };
    let text = with_canary(&compacting(&config(Some(&redis.url()), "adopt")));
    // What the operator writes after the promotion: the candidate's policy, no rollout.
    let plain = compacting(&config(Some(&redis.url()), "adopt"));
    assert!(plain.contains(LIVE_POLICY));
    let promoted = plain.replace(LIVE_POLICY, "policy = { name = \"lqm\" }");
    let (a, b, mut sa, mut sb) = two_instances(&text).await;
    // Canary traffic until a compaction: the snapshot then holds lqm-ts's live state and the
    // candidate's, and no end.
    let mut compactions = 0;
    for (n, o) in workload(1200).into_iter().enumerate() {
        route_to_candidate(&a, o);
        if n % 100 == 99 {
            compactions += usize::from(sa.sync_once(&a).await.unwrap().compacted);
        }
    }
    assert!(compactions >= 1, "{compactions}");
    feed(&b, &workload(30));
    sb.sync_once(&b).await.unwrap();
    // Before any promotion the promoted configuration is another configuration.
    let err = refused_at_start(&promoted, 6).await;
    assert!(err.contains("another configuration"), "{err}");
    a.end_rollout_by_operator(&a.interfaces()["chat"], true)
        .unwrap();
    assert!(!sa.sync_once(&a).await.unwrap().compacted);
    // F joins from the snapshot taken before the promotion, which the stream then brings.
    let f = app(&promoted, 7);
    let mut sf = Syncer::start(&redis_cfg(&promoted), &f).await.unwrap();
    assert!(sf.sync_once(&f).await.unwrap().loaded_snapshot);
    assert_eq!(f.interfaces()["chat"].policy_name(), "lqm");
    assert_close(&live_state(&f), &live_state(&a), "F's live policy");
    // Everyone's traffic then teaches the same policy: the old configuration with the
    // rollout (A, B) and the new one (F).
    feed(&f, &workload(60)[30..]);
    feed(&b, &workload(90)[60..]);
    for _ in 0..2 {
        sf.sync_once(&f).await.unwrap();
        sb.sync_once(&b).await.unwrap();
        sa.sync_once(&a).await.unwrap();
    }
    assert_close(&live_state(&f), &live_state(&a), "F and A");
    assert_close(&live_state(&b), &live_state(&a), "B and A");
    // G joins after compactions that hold the promotion, and follows too.
    let before = compactions;
    for chunk in workload(2000).chunks(40) {
        feed(&a, chunk);
        compactions += usize::from(sa.sync_once(&a).await.unwrap().compacted);
    }
    assert!(compactions > before, "{compactions}");
    let g = app(&promoted, 8);
    let mut sg = Syncer::start(&redis_cfg(&promoted), &g).await.unwrap();
    assert!(sg.sync_once(&g).await.unwrap().loaded_snapshot);
    assert_close(&live_state(&g), &live_state(&a), "G's live policy");
    // The old policy without the rollout still cannot follow, and says why.
    let d = app(&plain, 9);
    let mut sd = Syncer::start(&redis_cfg(&plain), &d).await.unwrap();
    let err = sd.sync_once(&d).await.unwrap_err().to_string();
    assert!(err.contains("has no rollout"), "{err}");
    // Neither does a third policy.
    let other = plain.replace(LIVE_POLICY, "policy = { name = \"linucb\" }");
    let err = refused_at_start(&other, 10).await;
    assert!(err.contains("another configuration"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_through_the_admin_route_reaches_every_gateway_and_one_started_later() {
    let Some(redis) = RedisServer::start("abort") else {
        return;
    };
    let text = format!(
        "[server]\nadmin_keys_env = [\"ADMIN_KEY\"]\n{}",
        with_canary(&config(Some(&redis.url()), "abort"))
    );
    let env = [("ADMIN_KEY", "admin-secret")];
    let admin = [("authorization", "Bearer admin-secret")];
    let (ga, gb) = (
        common::start(&text, &env).await,
        common::start(&text, &env).await,
    );
    let path = "/v1/interfaces/chat/rollout";
    let state_of = |r: common::Reply| r.json()["status"]["state"].clone();
    assert_eq!(
        state_of(common::http(gb.addr, "GET", path, &admin, "").await),
        "running"
    );
    let r = common::http(ga.addr, "POST", &format!("{path}/abort"), &admin, "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    // B syncs every 50 ms: it must show the abort within a few intervals (10 s on a loaded
    // machine at most).
    let until = |addr| async move {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let r = common::http(addr, "GET", path, &admin, "").await.json();
            if r["status"]["state"] == "aborted" || Instant::now() > deadline {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let rb = until(gb.addr).await;
    assert_eq!(rb["status"]["state"], "aborted", "{rb}");
    assert_eq!(rb["status"]["decided_by"], "another_instance", "{rb}");
    let metrics = common::http(gb.addr, "GET", "/metrics", &admin, "")
        .await
        .body;
    assert!(
        metrics.contains(
            "equiroute_rollout_events_received_total{interface=\"chat\",event=\"abort\"} 1"
        ) && metrics.contains("equiroute_rollout_active{interface=\"chat\"} 0"),
        "{metrics}"
    );
    // A second abort, on B, is refused: the rollout is not running there either.
    let r = common::http(gb.addr, "POST", &format!("{path}/abort"), &admin, "").await;
    assert_eq!(r.status, 409, "{}", r.body);
    let gc = common::start(&text, &env).await;
    let rc = until(gc.addr).await;
    assert_eq!(
        rc["status"]["state"], "aborted",
        "a gateway started later: {rc}"
    );
}

#[tokio::test]
async fn when_two_instances_end_a_canary_differently_the_first_end_in_the_stream_holds_everywhere()
{
    let Some(redis) = RedisServer::start("conflict") else {
        return;
    };
    let text = with_canary(&config(Some(&redis.url()), "conflict"));
    let (a, b, mut sa, mut sb) = two_instances(&text).await;
    feed(&b, &workload(60));
    // Within one sync interval: A's guard rolls back, B's operator promotes.
    roll_back(&a);
    b.end_rollout_by_operator(&b.interfaces()["chat"], true)
        .unwrap();
    assert_eq!(b.interfaces()["chat"].policy_name(), "lqm");
    // A's rollback reaches the stream first.
    sa.sync_once(&a).await.unwrap();
    sb.sync_once(&b).await.unwrap();
    sa.sync_once(&a).await.unwrap();
    for (name, app) in [("A", &a), ("B", &b)] {
        let r = rollout_report(app);
        assert_eq!(r["status"]["state"], "rolled_back", "{name}: {r}");
        assert_eq!(app.interfaces()["chat"].policy_name(), "lqm-ts", "{name}");
    }
    assert_eq!(
        rollout_report(&b)["status"]["decided_by"],
        "another_instance"
    );
    assert_close(&live_state(&a), &live_state(&b), "the live policies");
    let promoted = "equiroute_rollout_events_received_total{interface=\"chat\",event=\"promote\"} ";
    assert!(
        arms_metric(&a, promoted).abs() < 1e-12,
        "A ignored B's later promotion"
    );
}

/// Posts a score with `key` to the gateway at `addr`.
async fn score_with(addr: std::net::SocketAddr, key: &str, id: &str) -> common::Reply {
    let auth = format!("Bearer {key}");
    let body = serde_json::json!({"request_id": id, "quality": 0.0}).to_string();
    common::http(
        addr,
        "POST",
        "/v1/feedback",
        &[("authorization", &auth)],
        &body,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_stays_bound_to_its_key_on_every_instance_sharing_redis() {
    let Some(redis) = RedisServer::start("bound") else {
        return;
    };
    let text = format!(
        "[server]\napi_keys_env = [\"KEY_A\", \"KEY_B\"]\n{}",
        config(Some(&redis.url()), "bound")
    );
    let env = [("KEY_A", "sk-a"), ("KEY_B", "sk-b")];
    let (ga, gb) = (
        common::start(&text, &env).await,
        common::start(&text, &env).await,
    );
    let ask = || async {
        let body =
            serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
        let r = common::http(
            ga.addr,
            "POST",
            "/v1/chat/completions",
            &[("authorization", "Bearer sk-a")],
            &body.to_string(),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        r.header("x-equiroute-request-id").unwrap().to_owned()
    };
    // Two of A's requests on gateway A; once A's second score is accepted on gateway B, B
    // holds both contexts (the journal is read in order).
    let (first, second) = (ask().await, ask().await);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = score_with(gb.addr, "sk-a", &second).await;
        if r.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "B never learnt A's request: {}",
            r.body
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Key B, on either instance: the answer of an id that was never issued.
    let never = "req-0123456789abcdef0123456789abcdef";
    for addr in [gb.addr, ga.addr] {
        let foreign = score_with(addr, "sk-b", &first).await;
        let unknown = score_with(addr, "sk-b", never).await;
        assert_eq!(
            foreign.status, 404,
            "B scored A's request: {}",
            foreign.body
        );
        assert_eq!(
            foreign.body.replace(&first, "<id>"),
            unknown.body.replace(never, "<id>")
        );
    }
    // Key A scores it on B, once across both.
    let r = score_with(gb.addr, "sk-a", &first).await;
    assert_eq!(
        (r.status, r.json()["status"].clone()),
        (200, "accepted".into()),
        "{}",
        r.body
    );
    let r = score_with(ga.addr, "sk-a", &first).await;
    assert_eq!(r.json()["status"], "duplicate", "{}", r.body);
}
