//! `lqm-ts` where quality changes: per seed, how fast traffic leaves a provider whose quality
//! drops and comes back after it recovers, the change detector's alarms, and its false alarms
//! where quality never changes.
//!
//! `cargo run --release -p equiroute-lab --example quality_drift -- SEEDS FIRST SCENARIOS [FIELD=VALUE ...]`
//!
//! - `SCENARIOS`: `all`, `drops` (the built-ins with a `quality-drop`), `stationary` (the
//!   others), or a comma-separated list of built-in names and scenario files (`.toml`);
//! - `FIELD=VALUE`: an `lqm-ts` parameter by its dotted path, the value read as JSON
//!   (`retest=0.1`, `shift.threshold=8`, `shift.threshold=0` turns detection off).
//!
//! Prints, per scenario, one line per seed: gold quality, regret, and for each event that
//! ends within the run its `departure_rounds` and `recovery_rounds` (rounds from its start
//! until its provider is first in < 30% of a bin-long window; from its end until ≥ 60%;
//! `-` never), and the shifts detected (`round provider direction from→to (scores)`). Then
//! the mean ± 95% interval of quality over the seeds, and the alarms per 10,000 requests.
//! Scenarios without a `quality-drop` count every alarm as false (the judge's drift of
//! `judge-drift` is a real change of the scores, reported on its own line).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use equiroute_lab::report::Summary;
use equiroute_lab::runner::{run_with, RunResult};
use equiroute_lab::scenario::{all_builtin, checked_sets, named, EventKind, ScenarioSpec};

/// `lqm-ts` through `spec` with `seed`, `sets` applied.
fn run_lqm_ts(spec: &ScenarioSpec, sets: &[(String, serde_json::Value)], seed: u64) -> RunResult {
    run_with(spec, "lqm-ts", sets, seed, spec.rounds).unwrap()
}

fn has_drop(spec: &ScenarioSpec) -> bool {
    spec.providers
        .iter()
        .flat_map(|p| &p.events)
        .any(|e| matches!(e.kind, EventKind::QualityDrop { .. }))
}

fn show(r: Option<usize>) -> String {
    r.map_or_else(|| "-".to_owned(), |x| x.to_string())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seeds: u64 = args.get(1).map_or(10, |s| s.parse().expect("SEEDS"));
    let first: u64 = args.get(2).map_or(1, |s| s.parse().expect("FIRST"));
    let scenarios = scenarios(args.get(3).map_or("drops", String::as_str));
    let sets = checked_sets(&scenarios[0], "lqm-ts", args.get(4..).unwrap_or_default())
        .unwrap_or_else(|e| {
            eprintln!("quality_drift: {e}");
            std::process::exit(2)
        });
    println!(
        "lqm-ts, seeds {first}..={}{}",
        first + seeds - 1,
        if sets.is_empty() {
            String::new()
        } else {
            format!(", with {}", args[4..].join(" "))
        }
    );
    let (mut false_alarms, mut stationary_requests) = (0usize, 0usize);
    for spec in &scenarios {
        let runs: Vec<RunResult> = (first..first + seeds)
            .map(|s| run_lqm_ts(spec, &sets, s))
            .collect();
        println!("{}", spec.name);
        for r in &runs {
            let events: Vec<String> = r
                .recovery
                .iter()
                .map(|e| {
                    format!(
                        "{} {}: departure {} recovery {}",
                        e.provider,
                        e.event,
                        show(e.departure_rounds),
                        show(e.rounds)
                    )
                })
                .collect();
            let shifts: Vec<String> = r
                .quality_shifts
                .iter()
                .map(|s| {
                    format!(
                        "{} {} {} {:.2}→{:.2} ({})",
                        s.round, s.provider, s.direction, s.from, s.to, s.scores
                    )
                })
                .collect();
            println!(
                "  seed {:>3}: quality {:.4} regret {:>6.1} | {} | shifts {}: {}",
                r.seed,
                r.quality,
                r.regret,
                events.join("; "),
                r.quality_shifts.len(),
                shifts.join(", ")
            );
        }
        let q = Summary::of(&runs.iter().map(|r| r.quality).collect::<Vec<_>>());
        let g = Summary::of(&runs.iter().map(|r| r.regret).collect::<Vec<_>>());
        let alarms: usize = runs.iter().map(|r| r.quality_shifts.len()).sum();
        let requests = runs.len() * spec.rounds;
        println!(
            "{}\tquality {:.4} ± {:.4}\tregret {:.1} ± {:.1}\talarms {alarms} in {requests} requests ({:.2} per 10,000){}",
            spec.name,
            q.mean,
            q.ci95,
            g.mean,
            g.ci95,
            1e4 * alarms as f64 / requests as f64,
            if has_drop(spec) { "" } else { ", all false" }
        );
        if !has_drop(spec) && spec.judge.drift_providers.is_empty() {
            false_alarms += alarms;
            stationary_requests += requests;
        }
    }
    if stationary_requests > 0 {
        println!(
            "false alarms where quality and the judge never change: {false_alarms} in {stationary_requests} requests ({:.3} per 10,000)",
            1e4 * false_alarms as f64 / stationary_requests as f64
        );
    }
}

/// The scenarios named by `arg` (module docs).
fn scenarios(arg: &str) -> Vec<ScenarioSpec> {
    let all = || all_builtin().unwrap().into_iter();
    match arg {
        "drops" => all().filter(has_drop).collect(),
        "stationary" => all().filter(|s| !has_drop(s)).collect(),
        list => named(list).unwrap(),
    }
}
