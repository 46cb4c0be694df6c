//! The metrics' unit tests: interning, the label sets, the series that start at 0.

use super::*;

/// The value of the first sample line starting with `prefix`.
fn value(text: &str, prefix: &str) -> String {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
        .rsplit(' ')
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn counters_add_up_per_label_set_and_render_escaped_with_their_type() {
    let m = Metrics::default();
    m.attempt("chat", "b", "ok");
    m.attempt("chat", "a", "ok");
    m.attempt("chat", "a", "ok");
    m.feedback("say \"hi\"");
    let text = m.render();
    let samples: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.starts_with("equiroute_attempts_total") || l.starts_with("equiroute_feedback_total")
        })
        .collect();
    assert_eq!(samples.len(), 3, "{text}");
    for line in [
        r#"equiroute_attempts_total{interface="chat",provider="a",status="ok"} 2"#,
        r#"equiroute_attempts_total{interface="chat",provider="b",status="ok"} 1"#,
        r#"equiroute_feedback_total{outcome="say \"hi\""} 1"#,
    ] {
        assert!(samples.contains(&line), "no {line} in\n{text}");
    }
    // Prometheus text 0.0.4: a counter's family is named with its `_total`, and no
    // OpenMetrics `# EOF` ends the text (the routes append their own families).
    assert!(
        text.contains("# TYPE equiroute_attempts_total counter\n"),
        "{text}"
    );
    assert!(text.contains("# TYPE equiroute_trace_spans_dropped_total counter\n"));
    assert!(!text.contains("# EOF"));
    assert!(
        !text.contains("equiroute_requests_total{"),
        "a counter never counted has no series"
    );
}

#[test]
fn histograms_render_cumulative_buckets_sum_and_count() {
    let m = Metrics::default();
    for us in [0.5, 2.5, 2.5, 7.0, 20_000.0] {
        m.router_time(us);
    }
    let meters = m.meters("chat", []);
    meters.request_end(30.0, 0.002);
    meters.request_end(9.0, 0.0);
    let text = m.render();
    let line = |prefix: &str| value(&text, prefix);
    assert_eq!(line(r#"equiroute_router_microseconds_bucket{le="1"}"#), "1");
    assert_eq!(line(r#"equiroute_router_microseconds_bucket{le="3"}"#), "3");
    assert_eq!(line(r#"equiroute_router_microseconds_bucket{le="8"}"#), "4");
    assert_eq!(
        line(r#"equiroute_router_microseconds_bucket{le="10000"}"#),
        "4"
    );
    assert_eq!(
        line(r#"equiroute_router_microseconds_bucket{le="+Inf"}"#),
        "5"
    );
    assert_eq!(line("equiroute_router_microseconds_sum"), "20012.5");
    assert_eq!(line("equiroute_router_microseconds_count"), "5");
    assert_eq!(line("equiroute_decision_microseconds_count"), "0");
    let chat = r#"equiroute_request_latency_ms_bucket{interface="chat","#;
    assert_eq!(line(&format!(r#"{chat}le="10"}}"#)), "1");
    assert_eq!(line(&format!(r#"{chat}le="50"}}"#)), "2");
    assert_eq!(
        line(r#"equiroute_request_latency_ms_sum{interface="chat"}"#),
        "39.0"
    );
    assert_eq!(
        line(r#"equiroute_request_cost_usd_bucket{interface="chat",le="0.003"}"#),
        "2"
    );
    assert_eq!(
        line(r#"equiroute_request_cost_usd_bucket{interface="chat",le="0.001"}"#),
        "1"
    );
}

#[test]
fn tokens_are_counted_by_provider_and_token_type() {
    let m = Metrics::default();
    let meters = m.meters("chat", ["a", "b"]);
    meters.provider_tokens(0, 120, 7);
    meters.provider_tokens(0, 2_000, 40);
    meters.provider_tokens(1, 5, 1);
    let text = m.render();
    let line = |prefix: &str| value(&text, prefix);
    let a_in = r#"interface="chat",provider="a",token_type="input""#;
    assert_eq!(
        line(&format!("equiroute_provider_tokens_sum{{{a_in}}}")),
        "2120.0"
    );
    assert_eq!(
        line(&format!("equiroute_provider_tokens_count{{{a_in}}}")),
        "2"
    );
    assert_eq!(
        line(&format!(
            r#"equiroute_provider_tokens_bucket{{{a_in},le="300"}}"#
        )),
        "1",
        "{text}"
    );
    let a_out = r#"interface="chat",provider="a",token_type="output""#;
    assert_eq!(
        line(&format!("equiroute_provider_tokens_sum{{{a_out}}}")),
        "47.0"
    );
    let b_out = r#"interface="chat",provider="b",token_type="output""#;
    assert_eq!(
        line(&format!("equiroute_provider_tokens_count{{{b_out}}}")),
        "1"
    );
    assert!(text.contains("# TYPE equiroute_provider_tokens histogram\n"));
}

#[test]
fn counts_from_many_threads_add_up() {
    let m = Metrics::default();
    // An interface's meters and the family lookups write the same series.
    let meters = m.meters("chat", ["a"]);
    let threads = 19;
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (m, meters) = (&m, &meters);
            scope.spawn(move || {
                for i in 0..100 {
                    if i % 2 == 0 {
                        m.request("chat", "ok");
                    } else {
                        meters.request(m, "ok");
                    }
                    m.router_time(4.0);
                    meters.request_end(30.0, 0.0);
                    meters.attempt(m, 0, "ok", 0.0);
                }
                if t == 0 {
                    meters.request(m, "failed");
                    m.attempt("chat", "a", "timeout");
                }
            });
        }
    });
    let text = m.render();
    let n = 100 * threads;
    let line = |prefix: &str| value(&text, prefix);
    assert_eq!(
        line(r#"equiroute_requests_total{interface="chat",outcome="ok"}"#),
        n.to_string()
    );
    assert_eq!(
        line(r#"equiroute_requests_total{interface="chat",outcome="failed"}"#),
        "1"
    );
    assert_eq!(
        line(r#"equiroute_router_microseconds_bucket{le="4"}"#),
        n.to_string()
    );
    assert_eq!(
        line("equiroute_router_microseconds_sum")
            .parse::<f64>()
            .ok(),
        Some(f64::from(4 * n))
    );
    assert_eq!(
        line(r#"equiroute_request_latency_ms_count{interface="chat"}"#),
        n.to_string()
    );
    assert_eq!(
        text.matches("equiroute_request_latency_ms_count").count(),
        1
    );
    assert_eq!(
        line(r#"equiroute_attempts_total{interface="chat",provider="a",status="ok"}"#),
        n.to_string()
    );
    assert_eq!(
        line(r#"equiroute_attempts_total{interface="chat",provider="a",status="timeout"}"#),
        "1"
    );
    assert_eq!(
        text.matches("equiroute_requests_total{").count(),
        5,
        "{text}"
    );
}

#[test]
fn the_closed_sets_are_the_words_the_recorders_are_given() {
    use equiroute_core::breaker::Transition;
    use equiroute_core::decision::{AttemptStatus, ProviderFailure};
    use equiroute_core::executor::RequestStatus;
    use equiroute_core::hedge::HedgeReason;
    for t in [
        Transition::Opened,
        Transition::HalfOpened,
        Transition::Closed,
    ] {
        assert!(BREAKER_TRANSITIONS.contains(&transition_name(t)));
    }
    for s in [
        AttemptStatus::Ok,
        AttemptStatus::ProviderError(ProviderFailure::Server),
        AttemptStatus::ClientError,
        AttemptStatus::Timeout,
        AttemptStatus::Cancelled,
    ] {
        assert!(ATTEMPT_STATUSES.contains(&s.as_str()), "{}", s.as_str());
    }
    for r in [
        HedgeReason::Quantile,
        HedgeReason::DeadlineRisk,
        HedgeReason::Priced,
        HedgeReason::Latency,
    ] {
        assert!(HEDGE_REASONS.contains(&r.as_str()), "{}", r.as_str());
    }
    for s in [
        RequestStatus::Succeeded { candidate: 0 },
        RequestStatus::ClientError { candidate: 0 },
        RequestStatus::DeadlineExceeded,
        RequestStatus::Exhausted,
    ] {
        let label = outcome_label(s);
        assert!(REQUEST_OUTCOMES.contains(&label), "{label}");
    }
}

#[test]
fn configured_series_start_at_zero_and_hedges_only_where_hedging_is_on() {
    let text = "[interfaces.chat]\nkind = \"chat\"\nhedge = { enabled = true }\n\
        [[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\n\
        sim = { latency = { p50_ms = 1, p95_ms = 2 } }\n\
        [interfaces.search]\nkind = \"chat\"\n\
        [[interfaces.search.providers]]\nid = \"a\"\nkind = \"sim\"\n\
        sim = { latency = { p50_ms = 1, p95_ms = 2 } }\n";
    let cfg = crate::config::load(text, "t.toml", &|_| None).unwrap_or_else(|e| panic!("{e}"));
    let m = Metrics::default();
    m.start_at_zero(&cfg);
    m.breaker("search", "a", "open");
    let text = m.render();
    for line in [
        r#"equiroute_breaker_transitions_total{interface="chat",provider="a",to="open"} 0"#,
        r#"equiroute_breaker_transitions_total{interface="search",provider="a",to="open"} 1"#,
        r#"equiroute_breaker_transitions_total{interface="search",provider="a",to="half_open"} 0"#,
        r#"equiroute_requests_total{interface="search",outcome="deadline_exceeded"} 0"#,
        r#"equiroute_attempts_total{interface="chat",provider="a",status="timeout"} 0"#,
        r#"equiroute_fallbacks_total{interface="chat"} 0"#,
        r#"equiroute_last_resort_total{interface="search"} 0"#,
        r#"equiroute_hedges_total{interface="chat",event="won"} 0"#,
        r#"equiroute_hedge_reasons_total{interface="chat",reason="priced"} 0"#,
        r#"equiroute_provider_latency_ms_count{interface="search",provider="a"} 0"#,
    ] {
        assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
    }
    assert!(!text.contains(r#"equiroute_hedges_total{interface="search""#));
    assert!(
        !text.contains("equiroute_state_snapshots_total{"),
        "no state file, no snapshots"
    );
}

#[test]
fn label_values_are_interned_once_and_capped() {
    let names = RwLock::default();
    let a = intern(&names, 2, "chat");
    let a2 = intern(&names, 2, &String::from("chat"));
    assert!(std::ptr::eq(a, a2), "the same value is kept once");
    assert_eq!(intern(&names, 2, "search"), "search");
    assert_eq!(
        intern(&names, 2, "third"),
        OVERFLOW,
        "past the cap: the overflow value"
    );
    assert_eq!(
        intern(&names, 2, "chat"),
        "chat",
        "kept values are still found"
    );
    assert_eq!(names.read().map(|s| s.len()).ok(), Some(2));
}
