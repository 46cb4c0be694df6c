//! Runs are reproducible, and their metrics mean what they say.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::float_cmp)]

use equiroute_lab::runner::run;
use equiroute_lab::scenario::builtin;

#[test]
fn the_same_seed_gives_the_same_run_and_another_seed_does_not() {
    let spec = builtin("sudden-ratelimit").unwrap();
    for policy in ["lqm-ts", "ts-deadline", "random"] {
        let a = run(&spec, policy, 7, 1500).unwrap();
        let b = run(&spec, policy, 7, 1500).unwrap();
        assert_eq!(a, b, "{policy}");
        let c = run(&spec, policy, 8, 1500).unwrap();
        assert!(
            (a.quality - c.quality).abs() > 0.0
                || (a.latency_mean_ms - c.latency_mean_ms).abs() > 0.0
        );
    }
}

#[test]
fn metrics_are_consistent() {
    let spec = builtin("websearch-load").unwrap();
    for policy in ["lqm", "static", "round-robin", "oracle"] {
        let r = run(&spec, policy, 3, 2000).unwrap();
        assert_eq!(r.rounds, 2000);
        let total: f64 = r.share.iter().sum();
        assert!(
            (total - 1.0).abs() < 1e-9,
            "{policy}: shares sum to {total}"
        );
        for v in [
            r.quality,
            r.deadline_miss_rate,
            r.request_failure_rate,
            r.attempt_failure_rate,
        ] {
            assert!((0.0..=1.0).contains(&v), "{policy}: {v}");
        }
        assert!(r.latency_p95_ms >= r.latency_mean_ms * 0.5 && r.latency_p95_ms <= 1500.0 + 1e-9);
        assert!(r.cost_per_request > 0.0 && r.regret >= 0.0);
        let last = *r.regret_over_time.last().unwrap();
        assert!((last - r.regret).abs() < 1e-9);
        assert!(
            r.regret_over_time.windows(2).all(|w| w[1] >= w[0] - 1e-12),
            "regret is cumulative"
        );
    }
    // The oracle is the regret reference: it has none.
    assert!(run(&spec, "oracle", 3, 500).unwrap().regret.abs() < 1e-12);
}

#[test]
fn the_static_policy_sends_everything_to_one_provider() {
    let spec = builtin("websearch-load").unwrap();
    let r = run(&spec, "static", 1, 800).unwrap();
    assert!(r.share[0] > 0.99, "{:?}", r.share);
}

/// A world of one provider `a` (10–20 ms answers) behind `token_bucket = { bucket }`, and
/// the outcome stream of seed 1.
fn bucket_world(bucket: &str) -> (equiroute_lab::world::World, rand_chacha::ChaCha8Rng) {
    use rand::SeedableRng;
    let spec = equiroute_lab::scenario::ScenarioSpec::from_toml(
        &format!(
            r#"
name = "bucket"
description = "one rate-limited provider"
rounds = 10
metric = "f1"
clusters = 1
policies = ["static"]

[[providers]]
id = "a"
quality = [0.5]
latency = {{ p50_ms = 10, p95_ms = 20 }}
token_bucket = {{ {bucket} }}
"#
        ),
        "bucket.toml",
    )
    .unwrap();
    (
        equiroute_lab::world::World::new(&spec),
        rand_chacha::ChaCha8Rng::seed_from_u64(1),
    )
}

#[test]
fn a_token_bucket_refuses_calls_beyond_its_rate_with_retry_after() {
    use equiroute_core::{AttemptStatus, ProviderFailure};
    let (mut world, mut rng) = bucket_world("rate_per_s = 1.0, burst = 2.0");
    // Two tokens at t = 0, then empty: the third call is refused until a token refills (1 s).
    assert_eq!(
        world.attempt(0, 0, 0.0, None, &mut rng).status,
        AttemptStatus::Ok
    );
    assert_eq!(
        world.attempt(0, 0, 0.0, None, &mut rng).status,
        AttemptStatus::Ok
    );
    let refused = world.attempt(0, 0, 0.0, None, &mut rng);
    assert_eq!(
        refused.status,
        AttemptStatus::ProviderError(ProviderFailure::RateLimited)
    );
    // Counted from the refusal's arrival: it ends with the next token, at 1000 ms.
    assert!((refused.latency.0 + refused.retry_after.unwrap().0 - 1000.0).abs() < 1e-9);
    assert!(refused.cost.0.abs() < 1e-15, "a 429 is not billed");
    assert!(
        world.true_value(0, 0, 500.0, 0, None) == 0.0,
        "the oracle knows the bucket is empty"
    );
    assert_eq!(
        world.attempt(0, 0, 1000.0, None, &mut rng).status,
        AttemptStatus::Ok
    );
}

#[test]
fn an_announcing_bucket_rests_its_provider_from_the_answer_that_empties_it() {
    use equiroute_core::AttemptStatus;
    let (mut world, mut rng) = bucket_world("rate_per_s = 1.0, burst = 2.0, announce = true");
    // Two tokens at t = 0: the first answer leaves one (and a bit by its end), so it says
    // nothing; the second leaves none, and the next token comes at 1000 ms: its answer, ending
    // at its latency L, rests the provider for 1000 − L ms, until that token.
    let first = world.attempt(0, 0, 0.0, None, &mut rng);
    assert_eq!((first.status, first.retry_after), (AttemptStatus::Ok, None));
    let second = world.attempt(0, 0, 0.0, None, &mut rng);
    assert_eq!(second.status, AttemptStatus::Ok);
    let rest = second
        .retry_after
        .expect("the emptying answer announces a rest");
    assert!(
        (second.latency.0 + rest.0 - 1000.0).abs() < 1e-9,
        "ends at {} + rests {}",
        second.latency.0,
        rest.0
    );
    // Without `announce` (the default) the same answers say nothing.
    let (mut world, mut rng) = bucket_world("rate_per_s = 1.0, burst = 2.0");
    for _ in 0..2 {
        let o = world.attempt(0, 0, 0.0, None, &mut rng);
        assert_eq!((o.status, o.retry_after), (AttemptStatus::Ok, None));
    }
}

/// The JSON's `per_seed` carries each seed's share of first choices and request-failure rate
/// per time bin, on the share plots' bins, so recovery can be measured without the plots.
#[test]
fn per_seed_json_carries_the_share_and_the_failure_rate_over_time() {
    use equiroute_lab::report::ScenarioReport;
    use equiroute_lab::runner::BINS;
    use equiroute_lab::scenario::ScenarioSpec;
    // One provider, down for the second half, one attempt per request: every request of the
    // first 20 bins (10 rounds each) is answered, none of the last 20.
    let spec = ScenarioSpec::from_toml(
        r#"
name = "down"
description = "one provider, down for the second half"
rounds = 400
metric = "f1"
clusters = 1
max_attempts = 1
policies = ["static"]

[[providers]]
id = "a"
quality = [0.5]
latency = { p50_ms = 10, p95_ms = 20 }
events = [{ kind = { type = "outage" }, start_round = 200, end_round = 400 }]
"#,
        "down.toml",
    )
    .unwrap();
    let runs: Vec<_> = [1, 2]
        .iter()
        .map(|&seed| run(&spec, "static", seed, 400).unwrap())
        .collect();
    let report = ScenarioReport::new("down", vec!["a".into()], &["static".into()], &runs);
    let json = serde_json::to_value(&report).unwrap();
    let starts: Vec<u64> = json["bin_start_rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(starts.len(), BINS);
    assert_eq!((starts[0], starts[1], starts[20]), (0, 10, 200));
    for (k, seed) in json["policies"]["static"]["per_seed"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let fails: Vec<f64> = seed["request_failure_rate_over_time"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(fails.len(), BINS);
        assert!(fails[..20].iter().all(|f| *f == 0.0), "{fails:?}");
        assert!(fails[20..].iter().all(|f| *f == 1.0), "{fails:?}");
        assert_eq!(seed["request_failure_rate"], 0.5);
        let share = seed["share_over_time"]["a"].as_array().unwrap();
        assert_eq!(share.len(), BINS);
        assert!(share.iter().all(|s| s.as_f64() == Some(1.0)));
        assert_eq!(seed["seed"], runs[k].seed);
    }
    // With two providers, each bin's shares sum to 1 and match the run's own series.
    let spec = builtin("error-burst-recovery").unwrap();
    let r = run(&spec, "round-robin", 3, 400).unwrap();
    let providers: Vec<String> = spec.providers.iter().map(|p| p.id.clone()).collect();
    let report = ScenarioReport::new(
        &spec.name,
        providers.clone(),
        &["round-robin".into()],
        std::slice::from_ref(&r),
    );
    let seed = &report.policies["round-robin"].per_seed[0];
    for b in 0..BINS {
        let total: f64 = providers.iter().map(|p| seed.share_over_time[p][b]).sum();
        assert!((total - 1.0).abs() < 1e-9, "bin {b}: {total}");
        assert_eq!(seed.share_over_time["beta"][b], r.share_over_time[b][1]);
    }
}

/// An error burst fails a share of calls while it lasts, billed, and only then.
#[test]
fn an_error_burst_is_time_limited() {
    use equiroute_core::{AttemptStatus, ProviderFailure};
    use equiroute_lab::world::World;
    use rand::SeedableRng;
    let spec = builtin("error-burst-recovery").unwrap();
    let mut world = World::new(&spec);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let mut count = |round: usize, world: &mut World| {
        (0..2000)
            .filter(|_| {
                world.attempt(0, round, 0.0, None, &mut rng).status
                    == AttemptStatus::ProviderError(ProviderFailure::Server)
            })
            .count() as f64
            / 2000.0
    };
    let (before, during, after) = (
        count(799, &mut world),
        count(800, &mut world),
        count(1400, &mut world),
    );
    assert!(before == 0.0 && after == 0.0, "{before} {after}");
    assert!((during - 0.6).abs() < 0.04, "{during}");
    assert!(world.true_value(0, 1000, 0.0, 0, None) < 0.45 * world.true_value(0, 0, 0.0, 0, None));
}

#[test]
fn hedging_stays_within_its_budget_and_adds_one_call_per_hedge() {
    use equiroute_core::hedge::{HedgeConfig, HedgeRule};
    use equiroute_lab::runner::run_hedged;
    let spec = builtin("tail-pair").unwrap();
    let rounds = 1500;
    let plain = run(&spec, "lqm-ts", 2, rounds).unwrap();
    assert_eq!((plain.hedge_rate, plain.hedge_win_rate), (0.0, 0.0));
    for rule in [
        HedgeRule::default(),
        HedgeRule::ObservedQuantile { quantile: 0.9 },
    ] {
        let cfg = HedgeConfig {
            enabled: true,
            rule,
            max_rate: 0.03,
            ..HedgeConfig::default()
        };
        let r = run_hedged(&spec, "lqm-ts", 2, rounds, &cfg).unwrap();
        // Hedges happen, within 3% of requests plus the burst of 5.
        assert!(r.hedge_rate > 0.0, "{rule:?}");
        assert!(
            r.hedge_rate <= 0.03 + 5.0 / rounds as f64 + 1e-12,
            "{rule:?}: {}",
            r.hedge_rate
        );
        assert!(r.hedge_win_rate > 0.0 && r.hedge_win_rate <= r.hedge_rate);
        // Every request makes its first call; a hedge is one more.
        assert!(r.calls_per_request >= 1.0 + r.hedge_rate - 1e-12);
        // The same seed gives the same hedged run.
        assert_eq!(r, run_hedged(&spec, "lqm-ts", 2, rounds, &cfg).unwrap());
    }
    let off = HedgeConfig {
        max_parallel: 3,
        ..HedgeConfig::default()
    };
    let err = run_hedged(&spec, "lqm-ts", 2, 10, &off)
        .unwrap_err()
        .to_string();
    assert!(err.contains("hedge.max_parallel"), "{err}");
}

#[test]
fn recovery_is_the_rounds_until_a_window_with_sixty_percent_of_first_choices() {
    use equiroute_lab::runner::recovery_rounds;
    // Provider 0 is first in rounds 10, 12, 13 and 14 onwards; windows of 5 rounds after an
    // event that ended at round 10: 10..15 has 4 of 5 (≥ 60%: 3) → 0 rounds.
    let firsts: Vec<Option<usize>> = (0..30)
        .map(|t| Some(usize::from(!(t == 10 || t >= 12))))
        .collect();
    assert_eq!(recovery_rounds(&firsts, 0, 10, 30, 5), Some(0));
    // From round 5: windows 5..10, 6..11, 7..12, 8..13 hold 0, 1, 1, 2 → 9..14 holds 10, 12,
    // 13: 4 rounds.
    assert_eq!(recovery_rounds(&firsts, 0, 5, 30, 5), Some(4));
    // Provider 1 is never first in 3 of 5 rounds after round 12; nor is a window cut short
    // by the limit counted.
    assert_eq!(recovery_rounds(&firsts, 1, 12, 30, 5), None);
    assert_eq!(recovery_rounds(&firsts, 0, 27, 30, 5), None);
    // A refused request is nobody's first choice.
    assert_eq!(recovery_rounds(&[None; 10], 0, 0, 10, 5), None);
}

#[test]
fn recovery_after_an_outage_is_short_for_a_policy_that_returns_and_never_for_one_that_stays() {
    use equiroute_lab::report::ScenarioReport;
    use equiroute_lab::scenario::ScenarioSpec;
    // Alpha is down for rounds 200..400 (50 s at 250 ms a request); the breaker's longest
    // open period is 30 s = 120 rounds, so a policy that always puts alpha first has it back
    // within 120 rounds (plus the window, 20 rounds, it needs to fill).
    let spec = ScenarioSpec::from_toml(
        r#"
name = "outage"
description = "alpha is down for 200 rounds"
rounds = 800
metric = "f1"
clusters = 1
policies = ["static-alpha", "static-beta"]

[[variants]]
label = "static-alpha"
policy = { name = "static", candidate = "alpha" }

[[variants]]
label = "static-beta"
policy = { name = "static", candidate = "beta" }

[[providers]]
id = "alpha"
quality = [0.8]
latency = { p50_ms = 100, p95_ms = 200 }
events = [{ kind = { type = "outage" }, start_round = 200, end_round = 400 }]

[[providers]]
id = "beta"
quality = [0.7]
latency = { p50_ms = 100, p95_ms = 200 }
"#,
        "outage.toml",
    )
    .unwrap();
    let mut runs = Vec::new();
    for seed in 1..=3 {
        for policy in ["static-alpha", "static-beta"] {
            runs.push(run(&spec, policy, seed, 800).unwrap());
        }
    }
    for r in &runs {
        assert_eq!(r.recovery.len(), 1);
        let e = &r.recovery[0];
        assert_eq!(
            (e.provider.as_str(), e.event.as_str(), e.end_round),
            ("alpha", "outage", 400)
        );
        match r.policy.as_str() {
            "static-alpha" => assert!(e.rounds.is_some_and(|n| n <= 120), "{e:?}"),
            _ => assert_eq!(e.rounds, None),
        }
    }
    let names = ["static-alpha".to_owned(), "static-beta".to_owned()];
    let report = ScenarioReport::new(
        &spec.name,
        vec!["alpha".into(), "beta".into()],
        &names,
        &runs,
    );
    let beta = &report.policies["static-beta"].recovery[0];
    assert_eq!((beta.never, beta.seeds), (3, 3));
    let alpha = &report.policies["static-alpha"].recovery[0];
    assert_eq!(alpha.never, 0);
    assert!(alpha.rounds.mean <= 120.0);
    // In the JSON per seed ("never" is null) and in the table.
    let json = serde_json::to_value(&report).unwrap();
    let per_seed = &json["policies"]["static-beta"]["per_seed"][0]["recovery_rounds"][0];
    assert!(per_seed["rounds"].is_null() && per_seed["end_round"] == 400);
    let table = report.table();
    assert!(table.contains("alpha outage →400"), "{table}");
    assert!(table.contains("never 3/3"), "{table}");
    assert!(table.contains("(never 0/3)"), "{table}");
}

#[test]
fn with_every_breaker_open_each_request_probes_one_provider_as_the_gateway_does() {
    use equiroute_lab::scenario::ScenarioSpec;
    // Both providers are down for the whole run. Once both breakers are open, the last
    // resort (`Eligible::last_resort`) half-opens the one that reopens soonest and the
    // request probes it: one call per request, none answered. (Without it, a request whose
    // candidates are all open is turned away by the breakers without a call.)
    let spec = ScenarioSpec::from_toml(
        r#"
name = "all-down"
description = "every provider is down"
rounds = 300
metric = "f1"
clusters = 1
max_attempts = 1
policies = ["round-robin"]

[[providers]]
id = "a"
quality = [0.8]
latency = { p50_ms = 100, p95_ms = 200 }
events = [{ kind = { type = "outage" }, start_round = 0, end_round = 300 }]

[[providers]]
id = "b"
quality = [0.7]
latency = { p50_ms = 100, p95_ms = 200 }
events = [{ kind = { type = "outage" }, start_round = 0, end_round = 300 }]
"#,
        "all-down.toml",
    )
    .unwrap();
    let r = run(&spec, "round-robin", 1, 300).unwrap();
    assert_eq!(r.request_failure_rate, 1.0);
    assert!(
        (r.calls_per_request - 1.0).abs() < 1e-12,
        "{}",
        r.calls_per_request
    );
    assert!(r.request_failure_rate_over_time.iter().all(|&f| f == 1.0));
}

/// A silent quality drop on the leader and its recovery, with `lqm-ts`'s defaults: alpha's
/// gold quality halves for rounds 300..900 (latency and errors unchanged). The change detector
/// finds the drop within a few scores, so alpha's share of a 35-round window is below 30%
/// within 50 rounds of the start; the re-test rule finds the return, so alpha is first in
/// 60% of such a window within 250 rounds of the end (measured: 21–155 on seeds 1–4). With
/// the detector off (the policy before it) alpha never gets its traffic back within the run.
#[test]
fn lqm_ts_leaves_a_provider_whose_quality_drops_and_returns_when_it_recovers() {
    use equiroute_lab::scenario::ScenarioSpec;
    let spec = ScenarioSpec::from_toml(
        r#"
name = "short-drop"
description = "alpha's quality halves for rounds 300..900"
rounds = 1400
metric = "f1"
clusters = 1
deadline_ms = 3000
l_ref_ms = 1500
policies = ["lqm-ts", "lqm-ts-off"]

[[variants]]
label = "lqm-ts-off"
policy = { name = "lqm-ts", shift = { threshold = 0 } }

[[providers]]
id = "alpha"
quality = [0.8]
latency = { p50_ms = 600, p95_ms = 1200 }
events = [{ kind = { type = "quality-drop", factor = 0.5 }, start_round = 300, end_round = 900 }]

[[providers]]
id = "beta"
quality = [0.7]
latency = { p50_ms = 700, p95_ms = 1400 }
"#,
        "short-drop.toml",
    )
    .unwrap();
    for seed in 1..=2 {
        let on = run(&spec, "lqm-ts", seed, spec.rounds).unwrap();
        let e = &on.recovery[0];
        assert!(e.departure_rounds.is_some_and(|r| r <= 50), "{seed}: {e:?}");
        assert!(e.rounds.is_some_and(|r| r <= 250), "{seed}: {e:?}");
        let seen: Vec<(&str, &str)> = on
            .quality_shifts
            .iter()
            .map(|s| (s.provider.as_str(), s.direction.as_str()))
            .collect();
        assert_eq!(seen, [("alpha", "down"), ("alpha", "up")], "{seed}");
        let down = &on.quality_shifts[0];
        assert!((300..330).contains(&down.round) && down.from > 0.7 && down.to < 0.55);
        let off = run(&spec, "lqm-ts-off", seed, spec.rounds).unwrap();
        assert!(off.quality_shifts.is_empty());
        assert_eq!(off.recovery[0].rounds, None, "{seed}");
    }
}
