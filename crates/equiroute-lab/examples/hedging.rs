//! Hedged requests in the laboratory: `lqm-ts` without hedging, with the model's hedge delay
//! (`deadline-risk`, a sweep of thresholds; `priced-saving`, a sweep of target hedge rates)
//! and with the classic fixed rule (hedge after the observed quantile of the first
//! candidate's latency, a sweep around the p95), all under the same hedge budget (at most 5%
//! of requests, burst 5), on the heavy-tailed scenarios.
//!
//! `cargo run --release -p equiroute-lab --example hedging [-- FIRST LAST [SVG_DIR]]` runs
//! seeds `FIRST..=LAST` (default 1..=5) and prints one Markdown table per scenario (mean ± 95%
//! interval over seeds); with `SVG_DIR` it writes `hedging-<scenario>.svg` there: deadline-miss
//! rate against extra calls, one line per rule. `-- FIRST LAST confirm THRESHOLD [Q…]` runs
//! only no hedging, the model at `THRESHOLD` and the fixed rule at the observed quantiles `Q`
//! (0.95 by default), and with `… priced R…` the priced rule at target rates `R`: the
//! confirmation on fresh seeds of settings chosen on others; `… latency Q…` adds the priced
//! rule (at the last of those rates, 4.5% without them) with latency hedges at A's predictive
//! quantiles `Q` on the requests it does not price. A scenario with several
//! deadlines (`tail-pair`) gets a second table, p99 and misses per deadline, because the
//! p99 of all its requests sits at a deadline whenever more than 1% are cut off there.
//! docs/hedging.md shows the output.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use equiroute_core::hedge::{HedgeConfig, HedgeRule};
use equiroute_core::policies::{CensoredTail, PolicyConfig};
use equiroute_lab::report::{plot, Summary};
use equiroute_lab::runner::{run, run_hedged, RunResult};
use equiroute_lab::scenario::{builtin, ScenarioSpec, Variant};

const SCENARIOS: [&str; 3] = ["heavy-tail", "tail-pair", "llm-tail"];
const POLICY: &str = "lqm-ts";
const THRESHOLDS: [f64; 5] = [0.1, 0.2, 0.3, 0.4, 0.5];
const QUANTILES: [f64; 3] = [0.9, 0.95, 0.98];
/// The head of a scenario's table.
const HEADER: &str = "| hedging | p50 ms | p95 ms | p99 ms | deadline misses % | quality | cost per request µ$ | extra calls % |\n|---|---|---|---|---|---|---|---|";
const TARGET_RATES: [f64; 4] = [0.02, 0.03, 0.04, 0.045];

fn config(rule: HedgeRule) -> HedgeConfig {
    HedgeConfig {
        enabled: true,
        rule,
        ..HedgeConfig::default()
    }
}

/// `spec` with `lqm-ts` spreading censored latencies by its belief's tail
/// (`censored_tail = "belief"`), under the same label (so the same random streams).
fn with_belief_tail(spec: &ScenarioSpec) -> ScenarioSpec {
    let mut cfg = spec.policy(POLICY).expect("policy");
    if let PolicyConfig::LqmTs(c) = &mut cfg {
        c.risk.censored_tail = CensoredTail::Belief;
    }
    let mut out = spec.clone();
    out.variants.retain(|v| v.label != POLICY);
    out.variants.push(Variant {
        label: POLICY.to_owned(),
        policy: cfg,
        min_propensity: 0.0,
        own_l_ref: true,
    });
    out
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

/// What to run: the seeds, the model's thresholds, the fixed rule's quantiles, the priced
/// rule's target rates (with the default belief, and with the belief tail), where to plot.
struct Plan {
    first: u64,
    last: u64,
    thresholds: Vec<f64>,
    quantiles: Vec<f64>,
    rates: Vec<f64>,
    tail_rates: Vec<f64>,
    latency_quantiles: Vec<f64>,
    loose_risks: Vec<f64>,
    svg_dir: Option<String>,
}

fn plan(args: &[String]) -> Plan {
    let first: u64 = args.first().map_or(1, |a| a.parse().expect("FIRST seed"));
    let last: u64 = args.get(1).map_or(5, |a| a.parse().expect("LAST seed"));
    let confirm: Option<f64> = (args.get(2).map(String::as_str) == Some("confirm"))
        .then(|| args.get(3).expect("THRESHOLD").parse().expect("THRESHOLD"));
    let Some(threshold) = confirm else {
        return Plan {
            first,
            last,
            thresholds: THRESHOLDS.to_vec(),
            quantiles: QUANTILES.to_vec(),
            rates: TARGET_RATES.to_vec(),
            tail_rates: TARGET_RATES.to_vec(),
            latency_quantiles: Vec::new(),
            loose_risks: Vec::new(),
            svg_dir: args.get(2).cloned(),
        };
    };
    // Quantiles, then `priced R…`, `tail R…`, `latency Q…`, `loose R…`.
    let mut lists: [Vec<f64>; 5] = Default::default();
    let mut at = 0;
    for a in &args[4..] {
        match a.as_str() {
            "priced" => at = 1,
            "tail" => at = 2,
            "latency" => at = 3,
            "loose" => at = 4,
            x => lists[at].push(x.parse().expect("a number")),
        }
    }
    let [quantiles, rates, tail_rates, latency_quantiles, loose_risks] = lists;
    Plan {
        first,
        last,
        thresholds: vec![threshold],
        quantiles: if quantiles.is_empty() {
            vec![0.95]
        } else {
            quantiles
        },
        rates,
        tail_rates,
        latency_quantiles,
        loose_risks: if loose_risks.is_empty() {
            vec![0.01]
        } else {
            loose_risks
        },
        svg_dir: None,
    }
}

/// Prints one row per labelled run set and returns the curve from `base` through them.
fn curve(
    base: (f64, f64),
    sets: Vec<(String, Vec<RunResult>)>,
    per_deadline: &mut Vec<String>,
) -> Vec<(f64, f64)> {
    let mut points = vec![base];
    for (label, runs) in sets {
        println!("{}", row(&label, &runs));
        per_deadline.extend(deadline_row(&label, &runs));
        points.push((
            mean(&runs, |r| r.hedge_rate) * 100.0,
            mean(&runs, |r| r.deadline_miss_rate) * 100.0,
        ));
    }
    points
}

/// The per-deadline table of a scenario with several deadlines (nothing otherwise).
fn print_by_deadline(name: &str, none: &[RunResult], rows: &[String]) {
    let Some(first) = none.first().filter(|r| !r.by_deadline.is_empty()) else {
        return;
    };
    println!("\n{name} by deadline: p99 ms and deadline misses % of the requests with each deadline (share of requests in the header)\n");
    let head: Vec<String> = first
        .by_deadline
        .iter()
        .map(|c| format!("{} ms ({:.0}%)", c.deadline_ms, c.share * 100.0))
        .collect();
    println!("| hedging | {} |", head.join(" | "));
    println!("|---|{}", "---|".repeat(head.len()));
    for line in rows {
        println!("{line}");
    }
}

/// One row of the per-deadline table: for each deadline of the scenario, p99 and misses
/// (mean ± 95% interval over seeds); `None` without several deadlines.
fn deadline_row(label: &str, runs: &[RunResult]) -> Option<String> {
    let classes = runs.first()?.by_deadline.len();
    if classes == 0 || runs.iter().any(|r| r.by_deadline.len() != classes) {
        return None;
    }
    let cells: Vec<String> = (0..classes)
        .map(|k| {
            let p99 = Summary::of(
                &runs
                    .iter()
                    .map(|r| r.by_deadline[k].latency_p99_ms)
                    .collect::<Vec<_>>(),
            );
            let miss = Summary::of(
                &runs
                    .iter()
                    .map(|r| r.by_deadline[k].deadline_miss_rate * 100.0)
                    .collect::<Vec<_>>(),
            );
            format!(
                "{:.0} ± {:.0} ms, {:.2} ± {:.2}%",
                p99.mean, p99.ci95, miss.mean, miss.ci95
            )
        })
        .collect();
    Some(format!("| {label} | {} |", cells.join(" | ")))
}

/// The priced rule (at the last of the plan's rates) with latency hedges, one run set per
/// loose risk and latency quantile, and each one's per-seed difference from `reference`.
fn latency_variants(
    plan: &Plan,
    all: &dyn Fn(Option<HedgeConfig>) -> Vec<RunResult>,
    reference: Option<&[RunResult]>,
) -> (Vec<(String, Vec<RunResult>)>, Vec<String>) {
    let latency_rate = plan.rates.last().copied().unwrap_or(0.045);
    let sets: Vec<(String, Vec<RunResult>)> = plan
        .loose_risks
        .iter()
        .flat_map(|&risk| plan.latency_quantiles.iter().map(move |&q| (risk, q)))
        .map(|(risk, q)| {
            let label = format!(
                "priced + latency p{} if miss ≤ {}%, target {}%",
                q * 100.0,
                risk * 100.0,
                latency_rate * 100.0
            );
            let h = priced_latency(latency_rate, Some(q), risk);
            (label, all(Some(h)))
        })
        .collect();
    let paired = reference.map_or_else(Vec::new, |reference| {
        sets.iter()
            .map(|(label, runs)| paired_row(label, runs, reference))
            .collect()
    });
    (sets, paired)
}

/// The table of [`paired_row`]s (nothing without them).
fn print_paired(name: &str, paired: &[String]) {
    if paired.is_empty() {
        return;
    }
    println!("\n{name}, latency hedges minus the priced rule alone, seed by seed (mean ± 95% interval; negative: fewer)\n");
    println!("| variant | Δ p99 ms | Δ deadline misses % | Δ extra calls % |");
    println!("|---|---|---|---|");
    for line in paired {
        println!("{line}");
    }
}

/// Per-seed differences `runs − reference` (the same seeds in the same order).
fn paired_row(label: &str, runs: &[RunResult], reference: &[RunResult]) -> String {
    let d = |f: fn(&RunResult) -> f64, scale: f64| {
        let xs: Vec<f64> = runs
            .iter()
            .zip(reference)
            .map(|(a, b)| (f(a) - f(b)) * scale)
            .collect();
        Summary::of(&xs)
    };
    let (p99, miss, calls) = (
        d(|r| r.latency_p99_ms, 1.0),
        d(|r| r.deadline_miss_rate, 100.0),
        d(|r| r.hedge_rate, 100.0),
    );
    format!(
        "| {label} | {:+.0} ± {:.0} | {:+.2} ± {:.2} | {:+.2} ± {:.2} |",
        p99.mean, p99.ci95, miss.mean, miss.ci95, calls.mean, calls.ci95
    )
}

fn priced(target_rate: f64) -> HedgeConfig {
    priced_latency(target_rate, None, 0.01)
}

/// The priced rule with latency hedges at A's predictive `latency_quantile` on the requests
/// it does not price (`None`: none).
fn priced_latency(target_rate: f64, latency_quantile: Option<f64>, loose_risk: f64) -> HedgeConfig {
    config(HedgeRule::PricedSaving {
        target_rate: Some(target_rate),
        tail_quantile: 0.95,
        latency_quantile,
        loose_risk,
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let plan = plan(&args);
    let (first, last) = (plan.first, plan.last);
    let seeds: Vec<u64> = (first..=last).collect();
    for name in SCENARIOS {
        let spec = builtin(name).expect("built-in scenario");
        let tail_spec = with_belief_tail(&spec);
        let rounds = spec.rounds;
        let on = |spec: &ScenarioSpec, hedge: Option<HedgeConfig>| -> Vec<RunResult> {
            seeds
                .iter()
                .map(|&seed| match hedge {
                    None => run(spec, POLICY, seed, rounds).expect("run"),
                    Some(h) => run_hedged(spec, POLICY, seed, rounds, &h).expect("run"),
                })
                .collect()
        };
        let all = |hedge: Option<HedgeConfig>| on(&spec, hedge);
        println!("\n### {name}: {POLICY}, seeds {first}–{last}, {rounds} rounds\n\n{HEADER}");
        let none = all(None);
        println!("{}", row("none", &none));
        let mut per_deadline: Vec<String> = deadline_row("none", &none).into_iter().collect();
        let base = (0.0, mean(&none, |r| r.deadline_miss_rate) * 100.0);
        let model = curve(
            base,
            plan.thresholds
                .iter()
                .map(|&t| {
                    let rule = HedgeRule::DeadlineRisk {
                        threshold: t,
                        tail_quantile: 0.95,
                    };
                    (format!("model, threshold {t}"), all(Some(config(rule))))
                })
                .collect(),
            &mut per_deadline,
        );
        let priced_sets: Vec<(String, Vec<RunResult>)> = plan
            .rates
            .iter()
            .map(|&r| {
                let label = format!("priced, target {}%", r * 100.0);
                (label, all(Some(priced(r))))
            })
            .collect();
        // The latency variants are compared seed by seed with the last priced rate.
        let reference = priced_sets.last().map(|(_, runs)| runs.clone());
        let priced_line = curve(base, priced_sets, &mut per_deadline);
        let tailed = curve(
            base,
            plan.tail_rates
                .iter()
                .map(|&r| {
                    let label = format!("priced + belief tail, target {}%", r * 100.0);
                    (label, on(&tail_spec, Some(priced(r))))
                })
                .collect(),
            &mut per_deadline,
        );
        let (latency_sets, paired) = latency_variants(&plan, &all, reference.as_deref());
        let _ = curve(base, latency_sets, &mut per_deadline);
        if !plan.tail_rates.is_empty() {
            let rule = HedgeRule::ObservedQuantile { quantile: 0.95 };
            let runs = on(&tail_spec, Some(config(rule)));
            println!("{}", row("fixed p95 + belief tail", &runs));
            per_deadline.extend(deadline_row("fixed p95 + belief tail", &runs));
        }
        let fixed = curve(
            base,
            plan.quantiles
                .iter()
                .map(|&q| {
                    let rule = HedgeRule::ObservedQuantile { quantile: q };
                    (
                        format!("fixed, observed p{}", q * 100.0),
                        all(Some(config(rule))),
                    )
                })
                .collect(),
            &mut per_deadline,
        );
        print_by_deadline(name, &none, &per_deadline);
        print_paired(name, &paired);
        if let Some(dir) = &plan.svg_dir {
            let svg = plot::curves(
                &format!("{name}: {POLICY}, seeds {first}-{last}"),
                "extra calls (hedges per 100 requests)",
                "deadline misses (%)",
                &[
                    ("model (threshold)".to_owned(), model),
                    ("priced (target rate)".to_owned(), priced_line),
                    ("priced + belief tail".to_owned(), tailed),
                    ("fixed (observed q)".to_owned(), fixed),
                ],
            );
            let path = format!("{dir}/hedging-{name}.svg");
            std::fs::write(&path, svg).expect("write the SVG");
            eprintln!("wrote {path}");
        }
    }
}
