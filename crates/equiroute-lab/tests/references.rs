//! What the laboratory must show, each over seeds 1..=5 at the scenario's full length. The
//! thresholds are the (and the references'); the scenarios were not tuned to them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use equiroute_lab::report::{ScenarioReport, Summary};
use equiroute_lab::runner::{run, RunResult, BINS};
use equiroute_lab::scenario::builtin;

fn runs(scenario: &str, policies: &[&str]) -> (ScenarioReport, Vec<RunResult>) {
    let spec = builtin(scenario).unwrap();
    let policies: Vec<String> = policies.iter().map(|p| (*p).to_owned()).collect();
    let mut all = Vec::new();
    for p in &policies {
        for seed in 1..=5 {
            all.push(run(&spec, p, seed, spec.rounds).unwrap());
        }
    }
    let providers = spec.providers.iter().map(|p| p.id.clone()).collect();
    (
        ScenarioReport::new(&spec.name, providers, &policies, &all),
        all,
    )
}

fn q(r: &ScenarioReport, p: &str) -> Summary {
    r.policies[p].quality
}

#[test]
fn strategyqa_additive_collapses_and_lqm_beats_sw_ucb() {
    let (r, _) = runs("strategyqa-hetero", &["lqm", "additive", "sw-ucb"]);
    let fast = r.policies["additive"].share["fast-useless"];
    assert!(
        fast > 0.5,
        "additive share on the fast useless provider: {fast:.2}"
    );
    let gap = q(&r, "lqm").mean - q(&r, "additive").mean;
    assert!(gap >= 0.15, "lqm − additive = {gap:.3}");
    // "Clearly": the confidence intervals do not overlap.
    let (l, s) = (q(&r, "lqm"), q(&r, "sw-ucb"));
    assert!(
        l.mean - l.ci95 > s.mean + s.ci95,
        "lqm {l:?} vs sw-ucb {s:?}"
    );
}

#[test]
fn websearch_lqm_matches_sw_ucb_on_f1_and_cuts_static_latency() {
    let (r, _) = runs("websearch-load", &["lqm", "sw-ucb", "static"]);
    assert!(
        q(&r, "lqm").mean >= q(&r, "sw-ucb").mean,
        "{:?} vs {:?}",
        q(&r, "lqm"),
        q(&r, "sw-ucb")
    );
    let miss = |p: &str| r.policies[p].deadline_miss_rate.mean;
    assert!(
        miss("lqm") < miss("static"),
        "SLA misses: lqm {} static {}",
        miss("lqm"),
        miss("static")
    );
    let lat = |p: &str| r.policies[p].latency_mean_ms.mean;
    let cut = 1.0 - lat("lqm") / lat("static");
    assert!(cut >= 0.5, "static-provider latency cut {cut:.2}");
}

#[test]
fn priority_lists_need_the_right_order_and_lqm_does_not() {
    let (r, _) = runs(
        "priority-mismatch-k10",
        &["priority-tuned", "priority-wrong", "lqm"],
    );
    let (tuned, wrong, lqm) = (
        q(&r, "priority-tuned").mean,
        q(&r, "priority-wrong").mean,
        q(&r, "lqm").mean,
    );
    assert!(tuned > 0.55, "tuned {tuned}");
    assert!(wrong < 0.05, "wrong {wrong}");
    assert!(lqm >= 0.9 * tuned, "lqm {lqm} vs tuned {tuned}");
}

/// Share of first choices that went to providers whose id starts with `prefix`, per bin.
fn share_of(
    run: &RunResult,
    providers: &[String],
    prefix: &str,
    bins: std::ops::Range<usize>,
) -> f64 {
    let n = bins.len() as f64;
    bins.map(|b| {
        providers
            .iter()
            .enumerate()
            .filter(|(_, p)| p.starts_with(prefix))
            .map(|(i, _)| run.share_over_time[b][i])
            .sum::<f64>()
    })
    .sum::<f64>()
        / n
}

#[test]
fn ramp_ts_deadline_leaves_the_rate_limited_model_prefers_flex_and_costs_less() {
    let spec = builtin("ramp-ratelimit").unwrap();
    let (r, all) = runs("ramp-ratelimit", &["ts-deadline", "static-preference"]);
    let providers = &r.providers;
    // The window is rounds 2000..3500 of 6000: bins fully inside it, and the last quarter.
    let bin = |round: usize| round * BINS / spec.rounds;
    let inside = (bin(2000) + 1)..bin(3500);
    let after = bin(4500)..BINS;
    for run in all.iter().filter(|x| x.policy == "ts-deadline") {
        let during = share_of(run, providers, "gemini", inside.clone());
        let later = share_of(run, providers, "gemini", after.clone());
        assert!(
            during < 0.2,
            "seed {}: gemini share during the rate limit {during:.2}",
            run.seed
        );
        assert!(
            later > 0.5,
            "seed {}: gemini share after recovery {later:.2}",
            run.seed
        );
    }
    let share = &r.policies["ts-deadline"].share;
    let flex: f64 = share
        .iter()
        .filter(|(p, _)| p.ends_with("flex"))
        .map(|(_, v)| v)
        .sum();
    assert!(flex > 0.8, "flex share {flex:.2}");
    let cost = |p: &str| r.policies[p].cost_per_request.mean;
    assert!(
        cost("ts-deadline") <= 0.8 * cost("static-preference"),
        "{} vs {}",
        cost("ts-deadline"),
        cost("static-preference")
    );
    // Equal or lower bad-outcome rate: not worse beyond the two intervals.
    let (t, s) = (
        r.policies["ts-deadline"].request_failure_rate,
        r.policies["static-preference"].request_failure_rate,
    );
    assert!(
        t.mean <= s.mean + t.ci95.max(s.ci95),
        "bad outcomes: ts {t:?} static {s:?}"
    );
}

#[test]
fn lqm_ts_is_best_when_quality_deadlines_and_cost_mix() {
    let policies = [
        "lqm-ts",
        "lqm",
        "ts-deadline",
        "sw-ucb",
        "linucb",
        "cheapest",
    ];
    let (r, _) = runs("mixed-sla-cost", &policies);
    let ours = q(&r, "lqm-ts");
    for p in &policies[1..] {
        let other = q(&r, p);
        assert!(
            ours.mean - ours.ci95 > other.mean + other.ci95,
            "lqm-ts {ours:?} vs {p} {other:?}"
        );
    }
}

/// The bar for our policy: within noise (overlapping 95% intervals) of the best other
/// policy in every built-in scenario. The one exception is measured, not waived: in
/// `priority-mismatch-k10` the best other policy is a priority list handed the right order of
/// ten providers (it equals the oracle), and any learner pays for trying the other nine.
#[test]
fn lqm_ts_is_within_noise_of_the_best_other_policy_in_every_scenario() {
    use equiroute_lab::scenario::BUILTIN;
    let mut misses = Vec::new();
    for (name, _) in BUILTIN {
        let spec = builtin(name).unwrap();
        let policies: Vec<&str> = spec.policies.iter().map(String::as_str).collect();
        let (r, _) = runs(name, &policies);
        let ours = q(&r, "lqm-ts");
        let (best, b) = policies
            .iter()
            .filter(|p| !matches!(**p, "lqm-ts" | "oracle"))
            .map(|p| (*p, q(&r, p)))
            .max_by(|x, y| x.1.mean.total_cmp(&y.1.mean))
            .unwrap();
        if !ours.within_noise_of(&b) {
            misses.push(format!("{name}: lqm-ts {ours:?} vs {best} {b:?}"));
            // The tuned order is the oracle there; every learning policy is below lqm-ts.
            assert_eq!(*name, "priority-mismatch-k10", "{misses:?}");
            assert_eq!(best, "priority-tuned");
            assert!(b.mean - ours.mean < 0.02, "{misses:?}");
            for p in ["lqm", "sw-ucb", "round-robin", "priority-wrong"] {
                assert!(ours.mean > q(&r, p).mean, "lqm-ts vs {p}");
            }
        }
    }
    assert!(misses.len() <= 1, "{misses:?}");
}
