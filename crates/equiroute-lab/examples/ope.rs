//! The laboratory proof of off-policy evaluation (docs/ope.md).
//!
//! For each scenario and seed: log one policy's traffic with an exploration floor, evaluate
//! other policies offline from that log (each replayed on the logged observations in order
//! and asked for its first-choice distribution on every logged context, once learning from
//! every logged request, once from a sample of them as it would have served them itself,
//! rejection sampling with a constant bound, and once from a uniformly random sample of the
//! same expected size), run each of them
//! on-policy on the same scenario and seed for its true mean quality, and compare: estimate,
//! truth, error, and whether the 95% bootstrap interval covers the truth, for IPS, SNIPS and
//! DR. The bar: intervals cover the truth in at least 90% of the cases the evaluator does not
//! warn about, and DR's mean absolute error is below IPS's.
//!
//! ```text
//! cargo run -p equiroute-lab --example ope -- [--seeds N] [--first-seed S] [--rounds R]
//!     [--logger lqm-ts] [--floor 0.05] [--draws 50] [--scenarios a,b,...] [--jobs 2] [--rows]
//!     [--tsv FILE] [--learning-gap-warn 0.5] [--learning-check own-vs-sample]
//!     [--block 0] [--load-window 50]
//! ```
//!
//! `--learning-check all-vs-own` is the learning warning before the random-sample replay
//! (warned when learning from every request and as on its own traffic differ).
//!
//! `--block 1 --load-window 0` is the evaluator before the block bootstrap and the load test
//! (iid bootstrap, round-robin cross-fitting, no load-interference warning).
//!
//! Defaults: seeds 1-5, each scenario's rounds, four scenarios, lqm-ts logging with a 0.05
//! floor. A progress line goes to stderr; the summary (and with `--rows` every case) to
//! stdout as Markdown.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::cast_precision_loss,
    clippy::too_many_lines
)]

use equiroute_core::ope::{Estimate, Estimator, LearningCheck, OpeOptions};
use equiroute_lab::ope::{evaluate_targets, OpeCase};
use equiroute_lab::runner::run;
use equiroute_lab::scenario::{builtin, Variant};
use std::fmt::Write as _;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

struct Args {
    seeds: u64,
    first_seed: u64,
    rounds: Option<usize>,
    logger: String,
    floor: f64,
    draws: u32,
    scenarios: Vec<String>,
    targets: Option<Vec<String>>,
    jobs: usize,
    rows: bool,
    tsv: Option<String>,
    learning_gap_warn: f64,
    learning_check: LearningCheck,
    block: u32,
    load_window: u32,
}

fn parse() -> Args {
    let mut a = Args {
        seeds: 5,
        first_seed: 1,
        rounds: None,
        logger: "lqm-ts".into(),
        floor: 0.05,
        draws: 50,
        scenarios: [
            "retriever-pool",
            "strategyqa-hetero",
            "llm-pool",
            "near-ties",
        ]
        .map(String::from)
        .to_vec(),
        targets: None,
        jobs: 2,
        rows: false,
        tsv: None,
        learning_gap_warn: OpeOptions::default().learning_gap_warn,
        learning_check: OpeOptions::default().learning_check,
        block: OpeOptions::default().bootstrap_block,
        load_window: OpeOptions::default().load_window,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--seeds" => a.seeds = value().parse().expect("--seeds: a number, e.g. 30"),
            "--first-seed" => a.first_seed = value().parse().expect("--first-seed: e.g. 6"),
            "--rounds" => a.rounds = Some(value().parse().expect("--rounds: e.g. 2000")),
            "--logger" => a.logger = value(),
            "--floor" => a.floor = value().parse().expect("--floor: e.g. 0.05"),
            "--draws" => a.draws = value().parse().expect("--draws: e.g. 50"),
            "--scenarios" => a.scenarios = value().split(',').map(String::from).collect(),
            "--targets" => a.targets = Some(value().split(',').map(String::from).collect()),
            "--jobs" => a.jobs = value().parse::<usize>().expect("--jobs: e.g. 2").max(1),
            "--rows" => a.rows = true,
            "--tsv" => a.tsv = Some(value()),
            "--learning-gap-warn" => {
                a.learning_gap_warn = value().parse().expect("--learning-gap-warn: e.g. 0.5");
            }
            "--learning-check" => {
                a.learning_check = match value().as_str() {
                    "all-vs-own" => LearningCheck::AllVsOwn,
                    "own-vs-sample" => LearningCheck::OwnVsSample,
                    other => panic!("--learning-check {other}: all-vs-own or own-vs-sample"),
                };
            }
            "--block" => a.block = value().parse().expect("--block: 0 (n^1/3) or a length"),
            "--load-window" => {
                a.load_window = value()
                    .parse()
                    .expect("--load-window: e.g. 50, 0 for no test");
            }
            other => panic!("unknown flag {other}: see the example's doc comment"),
        }
    }
    a
}

struct Job {
    spec: equiroute_lab::scenario::ScenarioSpec,
    targets: Vec<String>,
    seed: u64,
    rounds: usize,
}

fn main() {
    let args = parse();
    let logger_label = format!("{}+floor{}", args.logger, args.floor);
    let mut jobs = Vec::new();
    for name in &args.scenarios {
        let mut spec = builtin(name).unwrap_or_else(|e| panic!("scenario {name}: {e}"));
        let logger_cfg = spec.policy(&args.logger).expect("--logger: a policy name");
        spec.variants.push(Variant {
            label: logger_label.clone(),
            policy: logger_cfg,
            min_propensity: args.floor,
            own_l_ref: true,
        });
        // Every policy of the scenario but the logger itself.
        let targets: Vec<String> = args.targets.clone().unwrap_or_else(|| {
            spec.policies
                .iter()
                .filter(|p| **p != args.logger)
                .cloned()
                .collect()
        });
        let rounds = args.rounds.unwrap_or(spec.rounds);
        for seed in args.first_seed..args.first_seed + args.seeds {
            jobs.push(Job {
                spec: spec.clone(),
                targets: targets.clone(),
                seed,
                rounds,
            });
        }
    }
    let opts = OpeOptions {
        learning_gap_warn: args.learning_gap_warn,
        learning_check: args.learning_check,
        bootstrap_block: args.block,
        load_window: args.load_window,
        ..OpeOptions::default()
    };
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let cases: Mutex<Vec<OpeCase>> = Mutex::new(Vec::new());
    // (scenario, seed, regret and quality without the floor)
    let plain: Mutex<Vec<(String, u64, f64, f64)>> = Mutex::new(Vec::new());
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..args.jobs {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let out = evaluate_targets(
                    &job.spec,
                    &logger_label,
                    &job.targets,
                    job.seed,
                    job.rounds,
                    args.draws,
                    &opts,
                )
                .unwrap_or_else(|e| panic!("{e}"));
                cases.lock().unwrap().extend(out);
                let p = run(&job.spec, &args.logger, job.seed, job.rounds).unwrap();
                plain
                    .lock()
                    .unwrap()
                    .push((job.spec.name.clone(), job.seed, p.regret, p.quality));
                let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                eprint!(
                    "\rope: {d}/{} (scenario, seed) logs evaluated, {:.0} s",
                    jobs.len(),
                    started.elapsed().as_secs_f64()
                );
                let _ = std::io::stderr().flush();
            });
        }
    });
    eprintln!();
    let mut cases = cases.into_inner().unwrap();
    cases.sort_by(|a, b| {
        (a.scenario.as_str(), a.target.as_str(), a.seed).cmp(&(
            b.scenario.as_str(),
            b.target.as_str(),
            b.seed,
        ))
    });
    report(&args, &logger_label, &cases);
    if let Some(path) = &args.tsv {
        write_tsv(path, &cases);
    }
    floor_cost(&args, &cases, &plain.into_inner().unwrap());
}

/// What the exploration floor costs the logging policy: regret and quality with and without.
fn floor_cost(args: &Args, cases: &[OpeCase], plain: &[(String, u64, f64, f64)]) {
    println!(
        "\nThe floor's cost: `{}` with and without min_propensity = {}, mean ± sd over seeds\n",
        args.logger, args.floor
    );
    println!("| scenario | regret without | regret with | quality without | quality with |");
    println!("|---|---|---|---|---|");
    for name in &args.scenarios {
        let without: Vec<&(String, u64, f64, f64)> =
            plain.iter().filter(|p| &p.0 == name).collect();
        let mut with: Vec<(u64, f64, f64)> = cases
            .iter()
            .filter(|c| &c.scenario == name)
            .map(|c| (c.seed, c.logged_regret, c.logged_value))
            .collect();
        with.sort_by_key(|w| w.0);
        with.dedup_by_key(|w| w.0);
        let (rw, rws) = mean_sd(&without.iter().map(|p| p.2).collect::<Vec<_>>());
        let (qw, qws) = mean_sd(&without.iter().map(|p| p.3).collect::<Vec<_>>());
        let (rf, rfs) = mean_sd(&with.iter().map(|w| w.1).collect::<Vec<_>>());
        let (qf, qfs) = mean_sd(&with.iter().map(|w| w.2).collect::<Vec<_>>());
        println!("| {name} | {rw:.1} ± {rws:.1} | {rf:.1} ± {rfs:.1} | {qw:.4} ± {qws:.4} | {qf:.4} ± {qfs:.4} |");
    }
}

fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let m = xs.iter().sum::<f64>() / n;
    let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, v.sqrt())
}

fn report(args: &Args, logger: &str, cases: &[OpeCase]) {
    let last = args.first_seed + args.seeds - 1;
    println!(
        "logger `{logger}`, seeds {}-{last}, {} cases, {} draws per Thompson distribution, 95% percentile block bootstrap ({} resamples, block {} (0: n^1/3)), load test over {} requests, DR with {}-fold cross-fitted ridge; intervals span both replays (learning from every request, from its own choices), warned beyond {} half-widths apart ({})\n",
        args.first_seed,
        cases.len(),
        args.draws,
        OpeOptions::default().bootstrap_resamples,
        args.block,
        args.load_window,
        OpeOptions::default().folds,
        args.learning_gap_warn,
        match args.learning_check {
            LearningCheck::AllVsOwn => "every request against its own traffic",
            LearningCheck::OwnVsSample =>
                "every request against its own traffic, and its own traffic against a random sample of the same size",
        },
    );
    summary(cases, |c| &c.estimates);
    println!(
        "\nBefore (the same replays, iid bootstrap, folds dealt one by one, no load tests):\n"
    );
    summary(cases, |c| &c.baseline);
    println!("\nPer (scenario, target), over seeds: mean truth, mean absolute error ± sd of the error, coverage of the unwarned cases (covered/unwarned), mean ESS\n");
    println!("| scenario | target | truth | replay truth | IPS err | SNIPS err | DR err | IPS cov | SNIPS cov | DR cov | ESS |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut groups: Vec<(&str, &str)> = cases
        .iter()
        .map(|c| (c.scenario.as_str(), c.target.as_str()))
        .collect();
    groups.dedup();
    for (s, t) in groups {
        let g: Vec<&OpeCase> = cases
            .iter()
            .filter(|c| c.scenario == s && c.target == t)
            .collect();
        let (truth, _) = mean_sd(&g.iter().map(|c| c.truth).collect::<Vec<_>>());
        let (replay_truth, _) = mean_sd(&g.iter().map(|c| c.replay_truth).collect::<Vec<_>>());
        let mut cells = Vec::new();
        for k in 0..3 {
            let errs: Vec<f64> = g.iter().map(|c| c.estimates[k].1.value - c.truth).collect();
            let mae = errs.iter().map(|x| x.abs()).sum::<f64>() / errs.len() as f64;
            let (_, sd) = mean_sd(&errs);
            cells.push(format!("{mae:.3} ± {sd:.3}"));
        }
        for k in 0..3 {
            let clean: Vec<&&OpeCase> = g
                .iter()
                .filter(|c| c.estimates[k].1.warnings.is_empty())
                .collect();
            let cov = clean
                .iter()
                .filter(|c| c.estimates[k].1.covers(c.truth))
                .count();
            cells.push(format!("{cov}/{}", clean.len()));
        }
        let (ess, _) = mean_sd(
            &g.iter()
                .map(|c| c.estimates[0].1.effective_sample_size)
                .collect::<Vec<_>>(),
        );
        println!(
            "| {s} | {t} | {truth:.3} | {replay_truth:.3} | {} | {ess:.0} |",
            cells.join(" | ")
        );
    }
    if args.rows {
        println!(
            "\n| scenario | target | seed | truth | IPS | SNIPS | DR | DR interval | warnings |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        for c in cases {
            let dr = &c.estimates[2].1;
            println!(
                "| {} | {} | {} | {:.4} | {:.4} | {:.4} | {:.4} | [{:.4}, {:.4}] | {} |",
                c.scenario,
                c.target,
                c.seed,
                c.truth,
                c.estimates[0].1.value,
                c.estimates[1].1.value,
                dr.value,
                dr.ci_low,
                dr.ci_high,
                warning_labels(&dr.warnings)
            );
        }
    }
}

/// The summary table of the estimates `pick` selects.
fn summary(cases: &[OpeCase], pick: impl Fn(&OpeCase) -> &Vec<(Estimator, Estimate)>) {
    println!("| estimator | cases without warning | covered | coverage | MAE (unwarned) | MAE (all) | mean bias (all) | covers replay truth | MAE vs replay truth | covers truth ± its own noise |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (k, e) in Estimator::ALL.iter().enumerate() {
        let errs: Vec<f64> = cases.iter().map(|c| pick(c)[k].1.value - c.truth).collect();
        let clean: Vec<&OpeCase> = cases
            .iter()
            .filter(|c| pick(c)[k].1.warnings.is_empty())
            .collect();
        let covered = clean
            .iter()
            .filter(|c| pick(c)[k].1.covers(c.truth))
            .count();
        let clean_mae = clean
            .iter()
            .map(|c| (pick(c)[k].1.value - c.truth).abs())
            .sum::<f64>()
            / clean.len().max(1) as f64;
        let mae = errs.iter().map(|x| x.abs()).sum::<f64>() / errs.len().max(1) as f64;
        let (bias, _) = mean_sd(&errs);
        let replay_cov = clean
            .iter()
            .filter(|c| pick(c)[k].1.covers(c.replay_truth))
            .count();
        let replay_mae = cases
            .iter()
            .map(|c| (pick(c)[k].1.value - c.replay_truth).abs())
            .sum::<f64>()
            / cases.len().max(1) as f64;
        // The interval's half-widths and the truth's own 95% noise, added in quadrature.
        let noisy_cov = clean
            .iter()
            .filter(|c| {
                let est = &pick(c)[k].1;
                let z = 1.96 * c.truth_se;
                let lo = est.value - (est.value - est.ci_low).hypot(z);
                let hi = est.value + (est.ci_high - est.value).hypot(z);
                lo <= c.truth && c.truth <= hi
            })
            .count();
        let pct = |x: usize| 100.0 * x as f64 / clean.len().max(1) as f64;
        println!(
            "| {e} | {} | {covered} | {:.1}% | {clean_mae:.4} | {mae:.4} | {bias:+.4} | {:.1}% | {replay_mae:.4} | {:.1}% |",
            clean.len(),
            pct(covered),
            pct(replay_cov),
            pct(noisy_cov),
        );
    }
}

/// Short labels of the warnings, `-` for none.
fn warning_labels(ws: &[equiroute_core::ope::SupportWarning]) -> String {
    use equiroute_core::ope::SupportWarning as W;
    if ws.is_empty() {
        return "-".to_owned();
    }
    ws.iter()
        .map(|w| match w {
            W::DeterministicLogger => "deterministic".to_owned(),
            W::UnsupportedAction { candidate, .. } => format!("unsupported {candidate}"),
            W::TinyPropensities { share } => format!("tiny {share:.3}"),
            W::LearningDependent {
                own_value,
                sample_value: None,
                ..
            } => format!("learning {own_value:.3}"),
            W::LearningDependent {
                own_value,
                sample_value: Some(sample),
                ..
            } => format!("learning {own_value:.3} sample {sample:.3}"),
            W::LowEffectiveSampleSize { ess } => format!("ess {ess:.0}"),
            W::LoadDependent {
                candidate,
                t,
                shift,
                ..
            } => format!("load {candidate} t={t:.1} shift={shift:+.4}"),
            W::LoadReactive {
                candidate,
                t,
                own_share,
                shift,
                ..
            } => format!("reacts {candidate} t={t:.1} own={own_share:.2} shift={shift:+.4}"),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every case, one line each, for analysis: the truths and each estimator's value, interval
/// and warnings, as reported (no prefix), and the replays alone: learning as on its own
/// traffic (`own_`), from every request (`all_`, its own interval) and from a random sample
/// of the same size (`sample_`); `before_` is the evaluator before the block bootstrap.
fn write_tsv(path: &str, cases: &[OpeCase]) {
    let mut out = String::from(
        "scenario\ttarget\tseed\ttruth\ttruth_se\treplay_truth\town_replay_truth\tsample_replay_truth",
    );
    for prefix in ["", "own_", "before_", "all_", "sample_"] {
        for e in Estimator::ALL {
            let _ = write!(
                out,
                "\t{prefix}{e}\t{prefix}{e}_lo\t{prefix}{e}_hi\t{prefix}{e}_warnings"
            );
        }
    }
    out.push('\n');
    for c in cases {
        let _ = write!(
            out,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            c.scenario,
            c.target,
            c.seed,
            c.truth,
            c.truth_se,
            c.replay_truth,
            c.own_replay_truth,
            c.sample_replay_truth
        );
        for (_, est) in c
            .estimates
            .iter()
            .chain(&c.own_estimates)
            .chain(&c.baseline)
            .chain(&c.all_estimates)
            .chain(&c.sample_estimates)
        {
            let _ = write!(
                out,
                "\t{}\t{}\t{}\t{}",
                est.value,
                est.ci_low,
                est.ci_high,
                warning_labels(&est.warnings)
            );
        }
        out.push('\n');
    }
    std::fs::write(path, out).unwrap_or_else(|e| panic!("--tsv {path}: {e}"));
}
