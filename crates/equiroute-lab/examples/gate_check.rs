//! `lqm-ts` with variants of the context gate (`lqm.head.gate`, `gate_z`) on
//! built-in scenarios, beside the best of the other learning policies.
//!
//! `cargo run --release -p equiroute-lab --example gate_check -- SEEDS FIRST SCENARIOS VARIANTS`
//!
//! - `SCENARIOS`: `all` or a comma-separated list of built-in names and scenario files (`.toml`);
//! - `VARIANTS`: comma-separated, each `as-is` (the scenario's `lqm-ts`), `off` (gate off),
//!   `centred` (gate as configured, `head.center = true`), `on` (gate on, the default `gate_z`), `z<Z>` (gate on, `gate_z = Z`; `z0` judges
//!   prediction errors, `gate_margin`), `z<Z>r<C>` (the same with the lock-in guard
//!   `gate_retry = C`), `z<Z>t<T>` (with near-ties `gate_tie_z = T`), or `others` (`lqm`, `ts-deadline`,
//!   `sw-ucb`, `linucb`, `additive`, each under its own label).
//!
//! Every `lqm-ts` variant runs under the label `lqm-ts`, so on the same random streams. Prints
//! per scenario and policy the mean gold quality and regret ± one standard error over the
//! seeds, and the per-seed regret. `GATE_CHECK_VERBOSE=1` adds each seed's share by bin and
//! recovery rounds, `GATE_CHECK_CURVE=1` the mean regret over time, shares of first choices,
//! failures, misses and spend ([`print_curve`]). `GATE_CHECK_EMA=B` sets every `lqm-ts`
//! variant's latency EMA weight `lqm.ema_beta` to `B`, `GATE_CHECK_WARMUP=scores|attempts`
//! its warm-up order `lqm.head.warmup_order`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use equiroute_core::estimators::linucb::WarmupOrder;
use equiroute_core::policies::PolicyConfig;
use equiroute_lab::runner::{run, run_policy, RunResult};
use equiroute_lab::scenario::{named, ScenarioSpec};
use equiroute_lab::world::World;

const OTHERS: [&str; 5] = ["lqm", "ts-deadline", "sw-ucb", "linucb", "additive"];

fn lqm_ts(spec: &ScenarioSpec, variant: &str, seed: u64) -> RunResult {
    let mut cfg = spec.policy("lqm-ts").unwrap();
    if let PolicyConfig::LqmTs(c) = &mut cfg {
        let head = &mut c.lqm.head;
        match variant {
            "as-is" => {}
            "off" => head.gate = false,
            "on" => head.gate = true,
            "centred" => head.center = true,
            v => {
                head.gate = true;
                // `z<Z>`, `z<Z>r<C>` or `z<Z>t<T>`: gate_z = Z and, with `r<C>`,
                // gate_retry = C, with `t<T>`, gate_tie_z = T.
                let (v, tie) = v.split_once('t').unwrap_or((v, "0"));
                head.gate_tie_z = tie.parse().expect("t<T>: a number, e.g. t2");
                let (z, retry) = v.split_once('r').unwrap_or((v, "0"));
                head.gate_z = z
                    .strip_prefix('z')
                    .and_then(|z| z.parse().ok())
                    .expect("a variant: as-is, off, on, z<Z>, z<Z>r<C> or z<Z>t<T>");
                head.gate_retry = retry.parse().expect("r<C>: a number, e.g. r1");
            }
        }
    }
    if let (Ok(o), PolicyConfig::LqmTs(c)) = (std::env::var("GATE_CHECK_WARMUP"), &mut cfg) {
        c.lqm.head.warmup_order = match o.as_str() {
            "scores" => WarmupOrder::Scores,
            "attempts" => WarmupOrder::Attempts,
            _ => panic!("GATE_CHECK_WARMUP: scores or attempts"),
        };
    }
    if let (Ok(t), PolicyConfig::LqmTs(c)) = (std::env::var("GATE_CHECK_EMA"), &mut cfg) {
        c.lqm.ema_beta = t.parse().unwrap();
    }
    let world = World::new(spec);
    let policy = cfg
        .build_with_floor(&world.candidates(), spec.feature_dim, &spec.floor("lqm-ts"))
        .unwrap();
    run_policy(spec, "lqm-ts", policy, seed, spec.rounds).unwrap()
}

fn mean_se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, (var / n).sqrt())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seeds: u64 = args.get(1).map_or(5, |s| s.parse().expect("SEEDS"));
    let first: u64 = args.get(2).map_or(1, |s| s.parse().expect("FIRST"));
    let scenarios = named(args.get(3).map_or("all", String::as_str)).unwrap();
    let variants: Vec<String> = args
        .get(4)
        .map_or("as-is,on", String::as_str)
        .split(',')
        .map(str::to_owned)
        .collect();
    let range = first..first + seeds;
    println!(
        "seeds {}..={}; mean ± standard error over seeds",
        range.start,
        range.end - 1
    );
    for spec in &scenarios {
        let mut rows: Vec<(String, Vec<RunResult>)> = Vec::new();
        for v in &variants {
            if v == "others" {
                for label in OTHERS {
                    let runs = range
                        .clone()
                        .map(|s| run(spec, label, s, spec.rounds).unwrap())
                        .collect();
                    rows.push((label.to_owned(), runs));
                }
            } else {
                let runs = range.clone().map(|s| lqm_ts(spec, v, s)).collect();
                rows.push((format!("lqm-ts {v}"), runs));
            }
        }
        let verbose = std::env::var_os("GATE_CHECK_VERBOSE").is_some();
        for (label, runs) in &rows {
            if verbose {
                for r in runs {
                    let alpha: Vec<String> = r
                        .share_over_time
                        .iter()
                        .map(|b| format!("{:.0}", 10.0 * b.first().copied().unwrap_or(0.0)))
                        .collect();
                    let rec: Vec<String> = r
                        .recovery
                        .iter()
                        .map(|x| format!("{:?}", x.rounds))
                        .collect();
                    println!(
                        "  {label} seed {}: first provider's share by bin (tenths) {} recovery {}",
                        r.seed,
                        alpha.join(""),
                        rec.join(" ")
                    );
                }
            }
            if std::env::var_os("GATE_CHECK_CURVE").is_some() {
                print_curve(label, runs);
            }
            let (q, qse) = mean_se(&runs.iter().map(|r| r.quality).collect::<Vec<_>>());
            let (g, gse) = mean_se(&runs.iter().map(|r| r.regret).collect::<Vec<_>>());
            let per: Vec<String> = runs.iter().map(|r| format!("{:.0}", r.regret)).collect();
            println!(
                "{}\t{label}\tquality {q:.4} ± {qse:.4}\tregret {g:.1} ± {gse:.1}\t[{}]",
                spec.name,
                per.join(" ")
            );
        }
    }
}

/// `GATE_CHECK_CURVE=1`: the mean cumulative regret at the end of every fourth time bin, each
/// provider's share of first choices in the first bin and over the run, and the request
/// failures, deadline misses and spend per request, means over the seeds.
fn print_curve(label: &str, runs: &[RunResult]) {
    let n = runs.len() as f64;
    let avg = |f: &dyn Fn(&RunResult) -> f64| runs.iter().map(f).sum::<f64>() / n;
    let bins = runs.first().map_or(0, |r| r.regret_over_time.len());
    let curve: Vec<String> = (0..bins)
        .step_by(4)
        .map(|b| format!("{:.1}", avg(&|r| r.regret_over_time[b])))
        .collect();
    println!("  {label}: mean regret by bin {}", curve.join(" "));
    let k = runs.first().map_or(0, |r| r.share.len());
    let first_bin: Vec<String> = (0..k)
        .map(|i| format!("{:.0}%", 100.0 * avg(&|r| r.share_over_time[0][i])))
        .collect();
    println!(
        "  {label}: first bin's share per provider {}",
        first_bin.join(" ")
    );
    let overall: Vec<String> = (0..k)
        .map(|i| format!("{:.1}%", 100.0 * avg(&|r| r.share[i])))
        .collect();
    println!(
        "  {label}: whole run's share per provider {}; request failures {:.2}%, deadline misses {:.2}%, ${:.5}/request",
        overall.join(" "),
        100.0 * avg(&|r| r.request_failure_rate),
        100.0 * avg(&|r| r.deadline_miss_rate),
        avg(&|r| r.cost_per_request)
    );
}
