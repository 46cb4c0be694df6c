//! Hedged requests in the laboratory: `lqm-ts` without hedging, with the model's hedge delay
//! (`deadline-risk`, a sweep of thresholds) and with the classic fixed rule (hedge after the
//! observed quantile of the first candidate's latency, a sweep around the p95), all under the
//! same hedge budget (at most 5% of requests, burst 5), on the heavy-tailed scenarios.
//!
//! `cargo run --release -p equiroute-lab --example hedging [-- FIRST LAST [SVG_DIR]]` runs
//! seeds `FIRST..=LAST` (default 1..=5) and prints one Markdown table per scenario (mean ± 95%
//! interval over seeds); with `SVG_DIR` it writes `hedging-<scenario>.svg` there: deadline-miss
//! rate against extra calls, one line per rule. `-- FIRST LAST confirm THRESHOLD [Q…]` runs
//! only no hedging, the model at `THRESHOLD` and the fixed rule at the observed quantiles `Q`
//! (0.95 by default): the confirmation on fresh seeds of a threshold chosen on others.
//! docs/hedging.md shows the output.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use equiroute_core::hedge::{HedgeConfig, HedgeRule};
use equiroute_lab::report::{plot, Summary};
use equiroute_lab::runner::{run, run_hedged, RunResult};
use equiroute_lab::scenario::builtin;

const SCENARIOS: [&str; 3] = ["heavy-tail", "tail-pair", "llm-tail"];
const POLICY: &str = "lqm-ts";
const THRESHOLDS: [f64; 5] = [0.1, 0.2, 0.3, 0.4, 0.5];
const QUANTILES: [f64; 3] = [0.9, 0.95, 0.98];

fn config(rule: HedgeRule) -> HedgeConfig {
    HedgeConfig {
        enabled: true,
        rule,
        ..HedgeConfig::default()
    }
}

fn row(label: &str, runs: &[RunResult]) -> String {
    let s = |f: fn(&RunResult) -> f64| Summary::of(&runs.iter().map(f).collect::<Vec<_>>());
    let fmt = |x: Summary, scale: f64, digits: usize| {
        format!("{:.digits$} ± {:.digits$}", x.mean * scale, x.ci95 * scale)
    };
    format!(
        "| {label} | {} | {} | {} | {} | {} | {} | {} |",
        fmt(s(|r| r.latency_p50_ms), 1.0, 0),
        fmt(s(|r| r.latency_p95_ms), 1.0, 0),
        fmt(s(|r| r.latency_p99_ms), 1.0, 0),
        fmt(s(|r| r.deadline_miss_rate), 100.0, 2),
        fmt(s(|r| r.quality), 1.0, 3),
        fmt(s(|r| r.cost_per_request), 1e6, 0),
        fmt(s(|r| r.hedge_rate), 100.0, 2),
    )
}

fn mean(runs: &[RunResult], f: fn(&RunResult) -> f64) -> f64 {
    runs.iter().map(f).sum::<f64>() / runs.len() as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let first: u64 = args.first().map_or(1, |a| a.parse().expect("FIRST seed"));
    let last: u64 = args.get(1).map_or(5, |a| a.parse().expect("LAST seed"));
    let confirm: Option<f64> = (args.get(2).map(String::as_str) == Some("confirm"))
        .then(|| args.get(3).expect("THRESHOLD").parse().expect("THRESHOLD"));
    let svg_dir = args.get(2).filter(|_| confirm.is_none());
    let thresholds = confirm.map_or(THRESHOLDS.to_vec(), |t| vec![t]);
    let quantiles = if confirm.is_some() {
        let listed: Vec<f64> = args[4..].iter().map(|q| q.parse().expect("Q")).collect();
        if listed.is_empty() {
            vec![0.95]
        } else {
            listed
        }
    } else {
        QUANTILES.to_vec()
    };
    let seeds: Vec<u64> = (first..=last).collect();
    for name in SCENARIOS {
        let spec = builtin(name).expect("built-in scenario");
        let rounds = spec.rounds;
        let all = |hedge: Option<HedgeConfig>| -> Vec<RunResult> {
            seeds
                .iter()
                .map(|&seed| match hedge {
                    None => run(&spec, POLICY, seed, rounds).expect("run"),
                    Some(h) => run_hedged(&spec, POLICY, seed, rounds, &h).expect("run"),
                })
                .collect()
        };
        println!("\n### {name}: {POLICY}, seeds {first}–{last}, {rounds} rounds\n");
        println!("| hedging | p50 ms | p95 ms | p99 ms | deadline misses % | quality | cost per request µ$ | extra calls % |");
        println!("|---|---|---|---|---|---|---|---|");
        let none = all(None);
        println!("{}", row("none", &none));
        let base = (0.0, mean(&none, |r| r.deadline_miss_rate) * 100.0);
        let mut model = vec![base];
        for &t in &thresholds {
            let runs = all(Some(config(HedgeRule::DeadlineRisk {
                threshold: t,
                tail_quantile: 0.95,
            })));
            println!("{}", row(&format!("model, threshold {t}"), &runs));
            model.push((
                mean(&runs, |r| r.hedge_rate) * 100.0,
                mean(&runs, |r| r.deadline_miss_rate) * 100.0,
            ));
        }
        let mut fixed = vec![base];
        for &q in &quantiles {
            let runs = all(Some(config(HedgeRule::ObservedQuantile { quantile: q })));
            println!("{}", row(&format!("fixed, observed p{}", q * 100.0), &runs));
            fixed.push((
                mean(&runs, |r| r.hedge_rate) * 100.0,
                mean(&runs, |r| r.deadline_miss_rate) * 100.0,
            ));
        }
        if let Some(dir) = svg_dir {
            let svg = plot::curves(
                &format!("{name}: {POLICY}, seeds {first}-{last}"),
                "extra calls (hedges per 100 requests)",
                "deadline misses (%)",
                &[
                    ("model (threshold)".to_owned(), model),
                    ("fixed (observed q)".to_owned(), fixed),
                ],
            );
            let path = format!("{dir}/hedging-{name}.svg");
            std::fs::write(&path, svg).expect("write the SVG");
            eprintln!("wrote {path}");
        }
    }
}
