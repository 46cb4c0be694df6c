//! Capacity behind a rate limit (issue 42, part 3, bar 3): per seed, what a policy pays and
//! how long it takes where a cheap provider's token bucket admits part of the traffic and a
//! dearer one takes the rest, against the capacity-aware `oracle` (the cheap provider whenever
//! it has a token) and `dear-only` (all traffic on the unlimited provider).
//!
//! `cargo run -p equiroute-lab --example capacity -- SEEDS FIRST SCENARIOS POLICIES [FIELD=VALUE ...]`
//!
//! - `SCENARIOS`: `capacity` (the built-ins whose name starts with `capacity-`) or a
//!   comma-separated list of built-in names and scenario files (`.toml`); each needs an
//!   `oracle` and a `dear-only` policy;
//! - `POLICIES`: comma-separated policy names or variant labels (default `lqm-ts,ts-deadline`);
//! - `FIELD=VALUE`: an `lqm-ts` parameter by its dotted path, the value read as JSON
//!   (`quality_tolerance=0.05`).
//!
//! Prints, per scenario and policy, one line per seed: cost per request over the oracle's,
//! mean latency over `dear-only`'s, requests without an answer, the limited provider's share
//! of first choices and of answers, and calls per request; then the mean, the smallest and
//! the largest of each over the seeds and whether every seed meets the bar (cost ≤ 1.1× the
//! oracle's, latency ≤ 1.1× `dear-only`'s, failures ≤ 0.5 %). `CAPACITY_VERBOSE=1` adds each
//! run's share of first choices of the limited provider per time bin.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use equiroute_lab::runner::{run, run_with, RunResult};
use equiroute_lab::scenario::{all_builtin, checked_sets, named, ScenarioSpec};

/// The bar: cost within 10 % of the oracle's, mean latency at most 1.1× the unlimited
/// provider's, at most 0.5 % of the requests without an answer.
const COST_BAR: f64 = 1.1;
const LATENCY_BAR: f64 = 1.1;
const FAILURE_BAR: f64 = 0.005;

/// One seed's row of a policy against the references.
struct Row {
    seed: u64,
    cost: f64,
    latency: f64,
    failures: f64,
    first_share: f64,
    calls: f64,
}

impl Row {
    fn of(r: &RunResult, oracle: &RunResult, dear: &RunResult, limited: usize) -> Row {
        Row {
            seed: r.seed,
            cost: r.cost_per_request / oracle.cost_per_request,
            latency: r.latency_mean_ms / dear.latency_mean_ms,
            failures: r.request_failure_rate,
            first_share: r.share.get(limited).copied().unwrap_or(0.0),
            calls: r.calls_per_request,
        }
    }

    fn meets_bar(&self) -> bool {
        self.cost <= COST_BAR && self.latency <= LATENCY_BAR && self.failures <= FAILURE_BAR
    }
}

/// `label` through `spec` with `seed`; `lqm-ts` with `sets` applied.
fn run_label(
    spec: &ScenarioSpec,
    label: &str,
    sets: &[(String, serde_json::Value)],
    seed: u64,
) -> RunResult {
    let sets = if label == "lqm-ts" { sets } else { &[] };
    run_with(spec, label, sets, seed, spec.rounds).unwrap()
}

fn spread(label: &str, xs: impl Iterator<Item = f64> + Clone) -> String {
    let n = xs.clone().count() as f64;
    let mean = xs.clone().sum::<f64>() / n;
    let lo = xs.clone().fold(f64::INFINITY, f64::min);
    let hi = xs.fold(f64::NEG_INFINITY, f64::max);
    format!("{label} {mean:.3} [{lo:.3}, {hi:.3}]")
}

/// A `FIELD=VALUE` argument refused: the reason, and exit status 2 (not a panic).
fn refused(e: &str) -> ! {
    eprintln!("capacity: {e}");
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seeds: u64 = args.get(1).map_or(5, |s| s.parse().expect("SEEDS"));
    let first: u64 = args.get(2).map_or(1, |s| s.parse().expect("FIRST"));
    let scenarios: Vec<ScenarioSpec> = match args.get(3).map_or("capacity", String::as_str) {
        "capacity" => all_builtin()
            .unwrap()
            .into_iter()
            .filter(|s| s.name.starts_with("capacity-"))
            .collect(),
        list => named(list).unwrap(),
    };
    let policies: Vec<&str> = args
        .get(4)
        .map_or("lqm-ts,ts-deadline", String::as_str)
        .split(',')
        .collect();
    let sets = checked_sets(&scenarios[0], "lqm-ts", args.get(5..).unwrap_or_default())
        .unwrap_or_else(|e| refused(&e));
    let range = first..first + seeds;
    if !sets.is_empty() {
        println!("lqm-ts with {}", args[5..].join(" "));
    }
    println!(
        "seeds {}..={}; cost / oracle's, mean latency / dear-only's, request failures, \
         limited provider's share of first choices, calls per request",
        range.start,
        range.end - 1
    );
    for spec in &scenarios {
        // The limited provider: the one with a token bucket.
        let limited = spec
            .providers
            .iter()
            .position(|p| p.token_bucket.is_some())
            .expect("a provider with a token_bucket");
        let refs: Vec<(RunResult, RunResult)> = range
            .clone()
            .map(|s| {
                (
                    run(spec, "oracle", s, spec.rounds).unwrap(),
                    run(spec, "dear-only", s, spec.rounds).unwrap(),
                )
            })
            .collect();
        let (o, d) = &refs[0];
        println!(
            "{}: oracle ${:.6}/request (limited provider first in {:.1} %), dear-only ${:.6}/request, {:.0} ms mean (seed {})",
            spec.name,
            o.cost_per_request,
            100.0 * o.share[limited],
            d.cost_per_request,
            d.latency_mean_ms,
            o.seed
        );
        for label in &policies {
            let verbose = std::env::var_os("CAPACITY_VERBOSE").is_some();
            let rows: Vec<Row> = range
                .clone()
                .zip(&refs)
                .map(|(s, (oracle, dear))| {
                    let r = run_label(spec, label, &sets, s);
                    if verbose {
                        // Tenths, 9 for 90 % and more: one digit per bin.
                        let bins: String = r
                            .share_over_time
                            .iter()
                            .map(|b| {
                                char::from_digit((10.0 * b[limited]).min(9.0) as u32, 10)
                                    .unwrap_or('?')
                            })
                            .collect();
                        println!("  {label:<12} seed {s:>2}: limited provider's share by bin (tenths) {bins}");
                    }
                    Row::of(&r, oracle, dear, limited)
                })
                .collect();
            for r in &rows {
                println!(
                    "  {label:<12} seed {:>2}: cost {:.3}  latency {:.3}  failures {:.2} %  share {:.3}  calls {:.3}{}",
                    r.seed,
                    r.cost,
                    r.latency,
                    100.0 * r.failures,
                    r.first_share,
                    r.calls,
                    if r.meets_bar() { "" } else { "  (misses the bar)" }
                );
            }
            let met = rows.iter().filter(|r| r.meets_bar()).count();
            println!(
                "{}\t{label}\t{}\t{}\t{}\t{}\tbar met on {met} of {} seeds",
                spec.name,
                spread("cost", rows.iter().map(|r| r.cost)),
                spread("latency", rows.iter().map(|r| r.latency)),
                spread("failures %", rows.iter().map(|r| 100.0 * r.failures)),
                spread("share", rows.iter().map(|r| r.first_share)),
                rows.len()
            );
        }
    }
}
