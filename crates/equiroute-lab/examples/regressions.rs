//! Before and after a change: every built-in scenario's runs of some policies, per seed, as a
//! table to keep, and the paired comparison of two such tables.
//!
//! `cargo run -p equiroute-lab --example regressions -- run SEEDS FIRST POLICIES [FIELD=VALUE ...] > after.tsv`
//! `cargo run -p equiroute-lab --example regressions -- diff before.tsv after.tsv`
//!
//! `run` prints one line per built-in scenario, policy (comma-separated names or variant
//! labels; a scenario runs those of them it can build) and seed: gold quality, regret,
//! deadline misses, cost per request and requests without an answer. Build it at each commit
//! (the file can be copied onto an older one) and keep the tables. `FIELD=VALUE` changes an
//! `lqm-ts` parameter by its dotted path, the value read as JSON (`retest=0.1`), as in the
//! `capacity` and `quality_drift` examples: a variant is measured without a rebuild.
//!
//! `diff` pairs the two tables by scenario, policy and seed, and prints per scenario and
//! policy the mean of each measure before and after and the mean paired difference with its
//! standard error over the seeds, marking with `!` a change for the worse by more than two
//! standard errors (and more than 1e-9: identical runs differ by nothing).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use equiroute_lab::runner::run_with;
use equiroute_lab::scenario::{all_builtin, checked_sets};
use std::collections::BTreeMap;

/// The measures, with whether a larger value is better.
const MEASURES: [(&str, bool); 5] = [
    ("quality", true),
    ("regret", false),
    ("misses", false),
    ("cost", false),
    ("failures", false),
];

fn run_table(seeds: u64, first: u64, policies: &str, set_args: &[String]) {
    let specs = all_builtin().unwrap();
    let sets: &[_] = &checked_sets(&specs[0], "lqm-ts", set_args).unwrap_or_else(|e| {
        eprintln!("regressions: {e}");
        std::process::exit(2)
    });
    println!("scenario\tpolicy\tseed\tquality\tregret\tmisses\tcost\tfailures");
    for spec in specs {
        for label in policies.split(',') {
            if spec.policy(label).is_err() {
                continue;
            }
            for seed in first..first + seeds {
                // The changes are lqm-ts's parameters: the other policies run as they are.
                let sets = if label == "lqm-ts" { sets } else { &[] };
                let r = run_with(&spec, label, sets, seed, spec.rounds).unwrap();
                println!(
                    "{}\t{label}\t{seed}\t{}\t{}\t{}\t{}\t{}",
                    spec.name,
                    r.quality,
                    r.regret,
                    r.deadline_miss_rate,
                    r.cost_per_request,
                    r.request_failure_rate
                );
            }
        }
    }
}

type Table = BTreeMap<(String, String), BTreeMap<u64, [f64; 5]>>;

fn read_table(path: &str) -> Table {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut table = Table::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split('\t').collect();
        let values: Vec<f64> = f[3..8].iter().map(|v| v.parse().unwrap()).collect();
        table
            .entry((f[0].to_owned(), f[1].to_owned()))
            .or_default()
            .insert(f[2].parse().unwrap(), values.try_into().unwrap());
    }
    table
}

fn diff(before: &str, after: &str) {
    let (before, after) = (read_table(before), read_table(after));
    println!(
        "scenario\tpolicy\tmeasure: before → after (after − before ± standard error over seeds)"
    );
    let mut worse = 0;
    for (key, old) in &before {
        let Some(new) = after.get(key) else {
            continue;
        };
        let seeds: Vec<u64> = old
            .keys()
            .filter(|s| new.contains_key(s))
            .copied()
            .collect();
        let n = seeds.len() as f64;
        let mut cells = Vec::new();
        for (m, (name, higher_better)) in MEASURES.iter().enumerate() {
            let d: Vec<f64> = seeds.iter().map(|s| new[s][m] - old[s][m]).collect();
            let mean = d.iter().sum::<f64>() / n;
            let var = d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
            let se = (var / n).sqrt();
            let o = seeds.iter().map(|s| old[s][m]).sum::<f64>() / n;
            let bad = if *higher_better { -mean } else { mean };
            let flag = if bad > 2.0 * se && bad > 1e-9 {
                worse += 1;
                "!"
            } else {
                ""
            };
            cells.push(format!(
                "{name} {o:.5} → {:.5} ({mean:+.5} ± {se:.5}){flag}",
                o + mean
            ));
        }
        println!("{}\t{}\t{}", key.0, key.1, cells.join("\t"));
    }
    println!("{worse} measures worse by more than two standard errors");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("run") => run_table(
            args.get(2).map_or(5, |s| s.parse().expect("SEEDS")),
            args.get(3).map_or(1, |s| s.parse().expect("FIRST")),
            args.get(4).map_or("lqm-ts,ts-deadline", String::as_str),
            args.get(5..).unwrap_or_default(),
        ),
        Some("diff") => diff(&args[2], &args[3]),
        _ => panic!("run SEEDS FIRST POLICIES | diff BEFORE AFTER"),
    }
}
