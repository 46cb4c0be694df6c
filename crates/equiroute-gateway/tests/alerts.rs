//! The example alerting rules and Grafana dashboard name real metrics (issue 46, bar 4): every
//! `equiroute_…` name in `examples/alerts.yml` and `examples/grafana-dashboard.json` has a
//! sample in `/metrics` right after start-up, before any traffic, and the series whose labels
//! the configuration fixes are there at 0 (so that `rate()` and absence alerts work from the
//! start).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, start};
use std::collections::BTreeSet;

/// The workspace root (this crate is `crates/equiroute-gateway`).
fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `equiroute_[a-z_]+` word of the file at `rel` (rule expressions, the dashboard's
/// `expr`, its variables and annotations, and any metric its text mentions).
fn named_metrics(rel: &str) -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
    let mut names = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("equiroute_") {
        let word: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        rest = &rest[at + word.len()..];
        names.insert(word);
    }
    assert!(!names.is_empty(), "{rel} names no metric");
    names
}

/// The names of the samples of an exposition (a histogram's `_bucket`, `_sum`, `_count`).
fn sample_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or(l).to_owned())
        .collect()
}

/// Whether the metric `name` has a sample: itself, or as a histogram, its count.
fn has(samples: &BTreeSet<String>, name: &str) -> bool {
    samples.contains(name) || samples.contains(&format!("{name}_count"))
}

/// Two interfaces of `sim` providers (one hedging), with `state` as the `[state]` table.
fn config(state: &str) -> String {
    format!(
        r#"
[state]
{state}

[interfaces.chat]
kind = "chat"
hedge = {{ enabled = true }}

[[interfaces.chat.providers]]
id = "a"
kind = "sim"
sim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}

[[interfaces.chat.providers]]
id = "b"
kind = "sim"
sim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}

[interfaces.search]
kind = "chat"

[[interfaces.search.providers]]
id = "a"
kind = "sim"
sim = {{ latency = {{ p50_ms = 1, p95_ms = 2 }} }}
"#
    )
}

/// `/metrics` of a gateway configured by `cfg`, scraped right after start-up.
async fn scraped_at_start(cfg: &str) -> String {
    let gw = start(cfg, &[]).await;
    let reply = http(gw.addr, "GET", "/metrics", &[], "").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.body
}

#[tokio::test]
async fn every_metric_the_examples_name_exists_from_start_up_at_zero() {
    let dir = std::env::temp_dir().join(format!("equiroute-alerts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = config(&format!(
        "path = {:?}\nsnapshot_interval_s = 3600",
        dir.join("state.redb")
    ));
    // A Redis that is never there (port 1): its families are written all the same.
    let redis = config("backend = \"redis\"\nurl = \"redis://127.0.0.1:1\"");
    let with_file = scraped_at_start(&file).await;
    let with_redis = scraped_at_start(&redis).await;
    let _ = std::fs::remove_dir_all(&dir);
    let (on_file, on_redis) = (sample_names(&with_file), sample_names(&with_redis));

    for example in ["examples/alerts.yml", "examples/grafana-dashboard.json"] {
        for name in named_metrics(example) {
            // The state families depend on the backend: one of the two gateways has them.
            let exists = if name.starts_with("equiroute_state_") {
                has(&on_file, &name) || has(&on_redis, &name)
            } else {
                has(&on_file, &name) && has(&on_redis, &name)
            };
            assert!(
                exists,
                "{example} names {name}, which /metrics does not have at start-up:\n{with_file}"
            );
        }
    }

    for sample in [
        r#"equiroute_breaker_transitions_total{interface="chat",provider="a",to="open"} 0"#,
        r#"equiroute_breaker_transitions_total{interface="chat",provider="b",to="half_open"} 0"#,
        r#"equiroute_breaker_transitions_total{interface="search",provider="a",to="closed"} 0"#,
        r#"equiroute_requests_total{interface="search",outcome="failed"} 0"#,
        r#"equiroute_requests_total{interface="chat",outcome="deadline_exceeded"} 0"#,
        r#"equiroute_attempts_total{interface="chat",provider="b",status="provider_error"} 0"#,
        r#"equiroute_fallbacks_total{interface="chat"} 0"#,
        r#"equiroute_last_resort_total{interface="search"} 0"#,
        r#"equiroute_hedges_total{interface="chat",event="started"} 0"#,
        r#"equiroute_hedges_total{interface="chat",event="won"} 0"#,
        r#"equiroute_hedges_total{interface="chat",event="cancelled"} 0"#,
        r#"equiroute_rejections_disputed_total{interface="chat",provider="a"} 0"#,
        r#"equiroute_quality_shifts_total{interface="search",provider="a",direction="down"} 0"#,
        r#"equiroute_provider_latency_ms_count{interface="chat",provider="b"} 0"#,
        r#"equiroute_state_snapshots_total{outcome="no_space"} 0"#,
    ] {
        assert!(
            with_file.lines().any(|l| l == sample),
            "no {sample} at start-up:\n{with_file}"
        );
    }
    // Hedge series only where hedging is on; nothing labelled by what a client sends.
    assert!(!with_file.contains(r#"equiroute_hedges_total{interface="search""#));
    assert!(!with_redis.contains("equiroute_state_snapshots_total{"));
}

#[test]
fn named_metrics_are_whole_words() {
    let names = sample_names("# TYPE h histogram\nh_bucket{le=\"1\"} 0\nh_count 0\nc_total 3\n");
    assert!(has(&names, "h") && has(&names, "h_bucket") && has(&names, "c_total"));
    assert!(!has(&names, "c"));
}
