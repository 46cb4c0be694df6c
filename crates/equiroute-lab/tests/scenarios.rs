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
policies = ["lqm", "round-robin"]

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
    assert!(all.len() >= 18);
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
        (MINIMAL.replace("\"lqm\", \"round-robin\"", "\"lqm\", \"fastest\""), "policies", "`fastest`"),
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

/// `MINIMAL` with provider b's latency replaced by `latency`.
fn with_b_latency(latency: &str) -> String {
    MINIMAL.replace("latency = { p50_ms = 300, p95_ms = 500 }", latency)
}

/// `MINIMAL` with provider b given the events `events` (an inline array).
fn with_b_events(events: &str) -> String {
    MINIMAL.replace(
        "latency = { p50_ms = 300, p95_ms = 500 }",
        &format!("latency = {{ p50_ms = 300, p95_ms = 500 }}\nevents = {events}"),
    )
}

#[test]
fn latency_mixtures_and_pareto_tails_load_and_bad_ones_name_the_field() {
    use equiroute_lab::world::latency::LatencyModel;
    let mix = "latency = { mixture = [{ weight = 0.7, p50_ms = 80, p95_ms = 150 }, { weight = 0.3, p50_ms = 2500, p95_ms = 4000 }] }";
    let s = ScenarioSpec::from_toml(&with_b_latency(mix), "m.toml").unwrap();
    let LatencyModel::Mixture(parts) = s.providers[1].latency.model() else {
        panic!("not a mixture")
    };
    assert_eq!(parts.len(), 2);
    assert!((parts[0].0 - 0.7).abs() < 1e-12 && (parts[1].0 - 0.3).abs() < 1e-12);
    let tail =
        "latency = { p50_ms = 300, p95_ms = 700, tail = { shape = 1.3, from_quantile = 0.8 } }";
    let s = ScenarioSpec::from_toml(&with_b_latency(tail), "t.toml").unwrap();
    assert!(matches!(
        s.providers[1].latency.model(),
        LatencyModel::ParetoTail(_)
    ));
    // The plain form is unchanged.
    let s = ScenarioSpec::from_toml(MINIMAL, "p.toml").unwrap();
    assert!(matches!(
        s.providers[1].latency.model(),
        LatencyModel::LogNormal(_)
    ));

    let cases = [
        (
            "latency = { mixture = [{ weight = 0.7, p50_ms = 80, p95_ms = 150 }, { weight = 0.4, p50_ms = 2500, p95_ms = 4000 }] }",
            "providers[1] (b).latency.mixture`",
            "sum to 1 (they sum to 1.1",
        ),
        (
            "latency = { mixture = [{ weight = 0, p50_ms = 80, p95_ms = 150 }, { weight = 1, p50_ms = 2500, p95_ms = 4000 }] }",
            "providers[1] (b).latency.mixture[0].weight",
            "positive",
        ),
        (
            "latency = { mixture = [{ weight = 0.5, p50_ms = 80, p95_ms = 150 }, { weight = 0.5, p50_ms = 2500, p95_ms = 400 }] }",
            "providers[1] (b).latency.mixture[1]",
            "p50_ms ≤ p95_ms",
        ),
        (
            "latency = { p50_ms = 300, p95_ms = 500, mixture = [{ weight = 1, p50_ms = 80, p95_ms = 150 }] }",
            "providers[1] (b).latency`",
            "not both",
        ),
        (
            "latency = { p50_ms = 300 }",
            "providers[1] (b).latency`",
            "give `p50_ms` and `p95_ms`",
        ),
        (
            "latency = { p50_ms = 300, p95_ms = 700, tail = { shape = 0.9 } }",
            "providers[1] (b).latency.tail.shape",
            "above 1",
        ),
        (
            "latency = { p50_ms = 300, p95_ms = 700, tail = { shape = 2, from_quantile = 0.3 } }",
            "providers[1] (b).latency.tail.from_quantile",
            "between 0.5 and 0.999",
        ),
    ];
    for (latency, field, fix) in cases {
        let err = error_of(&with_b_latency(latency));
        assert!(err.contains(field) && err.contains(fix), "{latency}: {err}");
    }
    let err = error_of(&with_b_latency(
        "latency = { mixture = [{ weight = 1, p50_ms = 80, p59_ms = 150 }] }",
    ));
    assert!(
        err.contains("providers[1].latency.mixture[0].p59_ms"),
        "{err}"
    );
}

#[test]
fn every_event_kind_checks_its_own_fields_and_rejects_others() {
    // Each kind loads with its fields, start and end.
    for kind in [
        "{ type = \"rate-limit\", rate = 0.5, retry_after_ms = 1000 }",
        "{ type = \"error-burst\", rate = 0.6 }",
        "{ type = \"outage\" }",
        "{ type = \"degrade\", latency_factor = 3.0, failure_rate = 0.2, recover_round = 80 }",
        "{ type = \"spike\", latency_factor = 4.0 }",
        "{ type = \"quality-drop\", factor = 0.5 }",
        "{ type = \"quality-drop\", factor = 0.5, ramp_rounds = 40 }",
    ] {
        let text = with_b_events(&format!(
            "[{{ kind = {kind}, start_round = 10, end_round = 50 }}]"
        ));
        ScenarioSpec::from_toml(&text, "ok.toml").unwrap_or_else(|e| panic!("{kind}: {e}"));
    }
    // A field of another kind, or none at all, is an error naming it.
    for (kind, stray) in [
        ("{ type = \"outage\", rate = 1.0 }", "rate"),
        (
            "{ type = \"outage\", latency_factor = 3.0 }",
            "latency_factor",
        ),
        (
            "{ type = \"spike\", latency_factor = 2.0, factor = 0.5 }",
            "factor",
        ),
        (
            "{ type = \"error-burst\", rate = 0.5, retry_after_ms = 10 }",
            "retry_after_ms",
        ),
        (
            "{ type = \"rate-limit\", rate = 0.5, failure_rate = 0.1 }",
            "failure_rate",
        ),
    ] {
        let err = error_of(&with_b_events(&format!(
            "[{{ kind = {kind}, start_round = 10, end_round = 50 }}]"
        )));
        assert!(
            err.contains("providers[1].events[0].kind")
                && err.contains(&format!("unknown field `{stray}`")),
            "{kind}: {err}"
        );
    }
    // Values out of range name the kind's field.
    for (kind, field, fix) in [
        (
            "{ type = \"rate-limit\", rate = 1.5 }",
            "kind.rate",
            "between 0 and 1",
        ),
        (
            "{ type = \"rate-limit\", rate = 0.5, retry_after_ms = -1 }",
            "kind.retry_after_ms",
            "≥ 0",
        ),
        (
            "{ type = \"error-burst\", rate = -0.1 }",
            "kind.rate",
            "between 0 and 1",
        ),
        (
            "{ type = \"degrade\", latency_factor = 0.5, failure_rate = 0.1 }",
            "kind.latency_factor",
            "≥ 1",
        ),
        (
            "{ type = \"degrade\", latency_factor = 2, failure_rate = 0.1, recover_round = 20 }",
            "kind.recover_round",
            "after end_round",
        ),
        (
            "{ type = \"spike\", latency_factor = 0 }",
            "kind.latency_factor",
            "positive",
        ),
        (
            "{ type = \"quality-drop\", factor = 2 }",
            "kind.factor",
            "between 0 and 1",
        ),
        (
            "{ type = \"quality-drop\", factor = 0.5, ramp_rounds = 41 }",
            "kind.ramp_rounds",
            "must fit in the event's 40 rounds",
        ),
    ] {
        let err = error_of(&with_b_events(&format!(
            "[{{ kind = {kind}, start_round = 10, end_round = 50 }}]"
        )));
        assert!(
            err.contains(&format!("providers[1] (b).events[0].{field}")) && err.contains(fix),
            "{kind}: {err}"
        );
    }
}

#[test]
fn silent_policy_assumptions_are_errors_that_say_what_was_assumed() {
    // `static` without a candidate among two providers would pick the first.
    let err = error_of(&MINIMAL.replace("\"round-robin\"", "\"static\""));
    assert!(
        err.contains("`policies`")
            && err.contains("first provider (`a`)")
            && err.contains("candidate = \"a\""),
        "{err}"
    );
    // Named in a variant, it loads.
    let named = MINIMAL.replace("\"round-robin\"", "\"static\"")
        + "\n[[variants]]\nlabel = \"static\"\npolicy = { name = \"static\", candidate = \"b\" }\n";
    let s = ScenarioSpec::from_toml(&named, "v.toml").unwrap();
    assert!(s.assumption("static").is_none());
    // `cheapest` where no provider has a price would rank by file order.
    let err = error_of(&MINIMAL.replace("\"round-robin\"", "\"cheapest\""));
    assert!(
        err.contains("`policies`") && err.contains("costs the same") && err.contains("file order"),
        "{err}"
    );
    // With prices it loads.
    let priced = MINIMAL
        .replace("\"round-robin\"", "\"cheapest\"")
        .replace("id = \"b\"", "id = \"b\"\nprice = { per_call = 0.001 }");
    assert!(ScenarioSpec::from_toml(&priced, "c.toml").is_ok());
}

#[test]
#[allow(clippy::float_cmp)] // values copied from the text, not computed
fn a_variant_gets_the_scenarios_l_ref_unless_it_sets_its_own() {
    use equiroute_core::policies::PolicyConfig;
    let text = MINIMAL.replace("deadline_ms = 1000", "deadline_ms = 1000\nl_ref_ms = 3000")
        + r#"
[[variants]]
label = "lqm-ts-budget"
policy = { name = "lqm-ts", objective = { kind = "risk-budget", max_bad = 0.03 } }

[[variants]]
label = "lqm-ts-own"
policy = { name = "lqm-ts", lqm = { l_ref_ms = 500 } }

[[variants]]
label = "lqm-tight"
policy = { name = "lqm", l_ref_ms = 800 }

[[variants]]
label = "additive-wide"
policy = { name = "additive" }
"#;
    let s = ScenarioSpec::from_toml(&text, "v.toml").unwrap();
    let l_ref = |label: &str| match s.policy(label).unwrap() {
        PolicyConfig::LqmTs(c) => c.lqm.l_ref_ms,
        PolicyConfig::Lqm(c) => c.l_ref_ms,
        PolicyConfig::Additive(c) => c.latency_scale_ms,
        other => panic!("{other:?}"),
    };
    // Unset in the variant: the scenario's, as for the plain name.
    assert_eq!(l_ref("lqm-ts-budget"), 3000.0);
    assert_eq!(l_ref("lqm-ts"), 3000.0);
    assert_eq!(l_ref("additive-wide"), 3000.0);
    // Set: kept.
    assert_eq!(l_ref("lqm-ts-own"), 500.0);
    assert_eq!(l_ref("lqm-tight"), 800.0);
    // A bad policy table still names the variant.
    let bad = MINIMAL.to_owned()
        + "\n[[variants]]\nlabel = \"x\"\npolicy = { name = \"lqm\", l_ref = 5 }\n";
    let err = error_of(&bad);
    assert!(err.contains("variants") && err.contains("l_ref"), "{err}");
}

/// A gradual quality drop: the factor falls linearly from 1 to `factor` over `ramp_rounds`,
/// reaching it at the ramp's last round, stays, and is gone at `end_round`; without a ramp it
/// is a step from `start_round` on.
#[test]
fn a_quality_drop_ramps_down_linearly_when_it_has_a_ramp() {
    use equiroute_lab::world::World;
    for (ramp, want) in [
        (
            40,
            [
                (9, 1.0),
                (10, 1.0 - 0.5 / 40.0),
                (29, 0.75),
                (49, 0.5),
                (59, 0.5),
                (60, 1.0),
            ],
        ),
        (
            0,
            [
                (9, 1.0),
                (10, 0.5),
                (29, 0.5),
                (49, 0.5),
                (59, 0.5),
                (60, 1.0),
            ],
        ),
    ] {
        let text = with_b_events(&format!(
            "[{{ kind = {{ type = \"quality-drop\", factor = 0.5, ramp_rounds = {ramp} }}, start_round = 10, end_round = 60 }}]"
        ));
        let spec = ScenarioSpec::from_toml(&text, "ramp.toml").unwrap();
        let world = World::new(&spec);
        for (round, factor) in want {
            let got = world.providers[1].conditions(round).quality_factor;
            assert!(
                (got - factor).abs() < 1e-12,
                "ramp {ramp}, round {round}: {got}"
            );
        }
    }
}

#[test]
fn a_policy_takes_field_value_changes_and_refuses_unknown_fields() {
    use equiroute_core::policies::PolicyConfig;
    use equiroute_lab::scenario::{checked_sets, parse_set};
    let s = ScenarioSpec::from_toml(MINIMAL, "tiny.toml").unwrap();
    let sets = [
        parse_set("quality_tolerance=0.05").unwrap(),
        // Left out of the JSON form at its default (0), and set all the same.
        parse_set("lqm.head.gate_retry=2").unwrap(),
    ];
    let PolicyConfig::LqmTs(c) = s.policy_with("lqm-ts", &sets).unwrap() else {
        panic!("not lqm-ts")
    };
    assert!((c.quality_tolerance - 0.05).abs() < 1e-12);
    assert!((c.lqm.head.gate_retry - 2.0).abs() < 1e-12);
    // The scenario's L_ref (its deadline) is kept.
    assert!((c.lqm.l_ref_ms - 1000.0).abs() < 1e-12);
    let typo = s
        .policy_with("lqm-ts", &[parse_set("lqm.head.gate_rety=2").unwrap()])
        .unwrap_err();
    assert!(typo.contains("gate_rety"), "{typo}");
    let missing = s
        .policy_with("lqm-ts", &[parse_set("lqm.nope.x=1").unwrap()])
        .unwrap_err();
    assert!(missing.contains("no field `nope`"), "{missing}");
    // A nested field named from the wrong level: the message lists the level's fields.
    let short = s
        .policy_with("lqm-ts", &[parse_set("head.gate_retry=2").unwrap()])
        .unwrap_err();
    assert!(
        short.contains("no field `head`") && short.contains("`lqm`"),
        "{short}"
    );
    let unchecked = ["head.gate_retry=2".to_owned()];
    assert!(checked_sets(&s, "lqm-ts", &unchecked).is_err());
    let fine = ["lqm.head.gate_retry=2".to_owned()];
    assert_eq!(checked_sets(&s, "lqm-ts", &fine).unwrap().len(), 1);
    assert!(parse_set("no-equals-sign").is_err());
}
