//! The scenario format: built-ins load, bad files are rejected with the field and the fix.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use equiroute_lab::scenario::{all_builtin, builtin, ScenarioError, ScenarioSpec, BUILTIN};

const MINIMAL: &str = r#"
name = "tiny"
description = "two providers"
rounds = 100
metric = "accuracy"
clusters = 2
deadline_ms = 1000
policies = ["lqm", "static"]

[[providers]]
id = "a"
quality = [0.5, 0.6]
latency = { p50_ms = 100, p95_ms = 200 }

[[providers]]
id = "b"
quality = [0.7, 0.4]
latency = { p50_ms = 300, p95_ms = 500 }
"#;

fn error_of(text: &str) -> String {
    ScenarioSpec::from_toml(text, "test.toml")
        .unwrap_err()
        .to_string()
}

#[test]
fn every_builtin_loads_and_lists_valid_policies() {
    let all = all_builtin().unwrap();
    assert_eq!(all.len(), BUILTIN.len());
    assert!(all.len() >= 14);
    for s in &all {
        for p in &s.policies {
            assert!(s.policy(p).is_ok(), "{}: {p}", s.name);
        }
        assert!(!s.description.is_empty());
    }
    let err = builtin("nope").unwrap_err().to_string();
    assert!(
        err.contains("unknown scenario `nope`") && err.contains("ramp-ratelimit"),
        "{err}"
    );
}

#[test]
fn a_minimal_scenario_loads_with_defaults() {
    let s = ScenarioSpec::from_toml(MINIMAL, "tiny.toml").unwrap();
    assert_eq!(s.feature_dim, 64);
    assert_eq!(s.max_attempts, 2);
    assert!(
        (s.l_ref() - 1000.0).abs() < 1e-12,
        "L_ref defaults to the deadline"
    );
}

#[test]
fn bad_scenarios_name_the_field_and_the_fix() {
    let cases = [
        (MINIMAL.replace("quality = [0.5, 0.6]", "quality = [0.5]"), "providers[0] (a).quality", "one value per cluster"),
        (MINIMAL.replace("p95_ms = 200", "p95_ms = 50"), "providers[0] (a).latency", "p50_ms ≤ p95_ms"),
        (MINIMAL.replace("\"lqm\", \"static\"", "\"lqm\", \"fastest\""), "policies", "`fastest`"),
        (MINIMAL.replace("id = \"b\"", "id = \"a\""), "providers[1] (a).id", "unique"),
        (MINIMAL.replace("rounds = 100", "rounds = 0"), "rounds", "at least 1"),
        (MINIMAL.replace("p95_ms = 200 }", "p95_ms = 200 }\nprice = { per_call = -0.01 }"), "providers[0] (a).price", "per_call"),
        (
            MINIMAL.replace("latency = { p50_ms = 300, p95_ms = 500 }", "latency = { p50_ms = 300, p95_ms = 500 }\nevents = [{ kind = { type = \"spike\", latency_factor = 2.0 }, start_round = 50, end_round = 10 }]"),
            "providers[1] (b).events[0]",
            "end_round must be after start_round",
        ),
    ];
    for (text, field, fix) in cases {
        let err = error_of(&text);
        assert!(
            err.contains("test.toml") && err.contains(field) && err.contains(fix),
            "{err}"
        );
    }
    // Unknown fields are syntax errors that name the field.
    let err = error_of(&MINIMAL.replace("clusters = 2", "clusters = 2\nclustres = 3"));
    assert!(err.contains("clustres"), "{err}");
    // Inside a table, with its path and its line and column.
    let err =
        error_of(&MINIMAL.replace("p50_ms = 300, p95_ms = 500", "p50_ms = 300, p59_ms = 500"));
    assert!(
        err.starts_with("test.toml: `providers[1].latency.p59_ms`: unknown field `p59_ms`")
            && err.ends_with("(line 18, column 27)"),
        "{err}"
    );
    assert!(matches!(
        ScenarioSpec::from_toml("rounds = ", "x.toml"),
        Err(ScenarioError::Parse { .. })
    ));
}
