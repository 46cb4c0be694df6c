//! What a replayed policy chooses, against what it chooses on its own traffic (docs/ope.md,
//! "Learning from the log, learning as on its own traffic").
//!
//! For each seed: the logger's run (`lqm-ts` with a 0.05 exploration floor), the target's own
//! run on the same scenario and seed, and the target replayed on the logger's log three ways
//! (learning from every logged request; from the requests kept with
//! `min(1, π(action)/propensity)`, the replay before; from those kept with
//! `c·π(action)/propensity`, `c` the smallest logged propensity). Per stretch of rounds: the
//! value of its first choices (their true expected values) and, per query cluster (named by
//! the provider that is best on it), its first-choice shares of the providers in percent.
//!
//! ```text
//! cargo run --release -p equiroute-lab --example ope_replays -- [target] [scenario] [seeds]
//! ```
//!
//! Defaults: `additive`, `retriever-pool`, 5 (seeds 1 to 5).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use equiroute_lab::ope::{replay, Learning, TrafficLog};
use equiroute_lab::runner::run_logged;
use equiroute_lab::scenario::{builtin, Variant};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::fmt::Write as _;

/// The provider with the highest true value: names the query's cluster where each cluster
/// has its own best provider (as in `retriever-pool`).
fn cluster(values: &[f64]) -> usize {
    (0..values.len())
        .max_by(|&a, &b| values[a].total_cmp(&values[b]))
        .unwrap_or(0)
}

fn row(label: &str, log: &TrafficLog, choices: &[Vec<f64>], from: usize, to: usize) {
    let k = log.candidates.len();
    let mut shares = vec![vec![0.0; k]; k];
    let mut n = vec![0.0f64; k];
    let mut value = 0.0;
    for (r, p) in log.rounds[from..to].iter().zip(&choices[from..to]) {
        let c = cluster(&r.values);
        n[c] += 1.0;
        for i in 0..k {
            shares[c][i] += p[i];
            value += p[i] * r.values[i];
        }
    }
    let mut line = format!(
        "{label:>10} [{from},{to}) value {:.4} ",
        value / (to - from).max(1) as f64
    );
    for c in 0..k {
        let _ = write!(line, " | c{c}:");
        for s in &shares[c] {
            let _ = write!(line, "{:4.0}", 100.0 * s / n[c].max(1.0));
        }
    }
    println!("{line}");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let target = args.first().cloned().unwrap_or_else(|| "additive".into());
    let scenario = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "retriever-pool".into());
    let seeds: u64 = args.get(2).map_or(5, |s| s.parse().expect("seeds: e.g. 5"));
    let mut spec = builtin(&scenario).unwrap_or_else(|e| panic!("scenario {scenario}: {e}"));
    spec.variants.push(Variant {
        label: "logger".into(),
        policy: spec.policy("lqm-ts").unwrap(),
        min_propensity: 0.05,
        own_l_ref: true,
    });
    let rounds = spec.rounds;
    for seed in 1..=seeds {
        let (logged, log) = run_logged(&spec, "logger", seed, rounds, 50).unwrap();
        let (own_run, own_log) = run_logged(&spec, &target, seed, rounds, 1).unwrap();
        let pct = |s: &[f64]| {
            s.iter()
                .map(|x| format!("{:.0}", 100.0 * x))
                .collect::<Vec<_>>()
                .join("/")
        };
        println!(
            "seed {seed}: logger quality {:.4}, shares {}; {target} on its own traffic {:.4}, shares {}",
            logged.quality,
            pct(&logged.share),
            own_run.quality,
            pct(&own_run.share)
        );
        let k = log.candidates.len();
        let on_policy: Vec<Vec<f64>> = own_log
            .rounds
            .iter()
            .map(|r| (0..k).map(|i| f64::from(u8::from(i == r.action))).collect())
            .collect();
        let mut replays = Vec::new();
        for learning in [Learning::All, Learning::Agreeing, Learning::Own] {
            let mut policy = spec
                .policy(&target)
                .and_then(|c| {
                    c.build_with_floor(&log.candidates, spec.feature_dim, &spec.floor(&target))
                })
                .unwrap();
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0ff_9011c7);
            let r = replay(&log, policy.as_mut(), &mut rng, 50, learning);
            let kept = r.learnt_from.iter().filter(|k| **k).count();
            println!("  {learning:?}: learnt from {kept} of {rounds} requests");
            replays.push(
                r.choices
                    .iter()
                    .map(|d| (0..k).map(|i| d.probability(i)).collect::<Vec<_>>())
                    .collect::<Vec<_>>(),
            );
        }
        for (from, to) in [(0, 200), (200, 1000), (1000, rounds)] {
            row("own run", &own_log, &on_policy, from, to);
            row("all", &log, &replays[0], from, to);
            row("agreeing", &log, &replays[1], from, to);
            row("own", &log, &replays[2], from, to);
        }
    }
}
