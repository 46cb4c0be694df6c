//! How close can a learner come to the hand-tuned order in `priority-mismatch-k10`?
//!
//! The scenario's ten providers have the same quality in every query cluster, and
//! `priority-tuned` is handed their true order: it is the oracle. A learner has to find the
//! order from judged scores (noisy, five rounds late). This example runs, through the
//! laboratory's own runner and world, a learner that is told what `lqm-ts` is not: that context
//! does not matter here. It keeps one mean per provider and samples it, Gaussian Thompson
//! sampling on the judged scores (prior: one pseudo-score of 0.5; variance 0.25 until two
//! scores, then the sample variance floored at 0.01), no warm-up, no latency or cost terms.
//! Its score is an estimate of what learning the order costs at the least, to set beside
//! `lqm-ts`, which learns per context and must also weigh latency, deadlines and cost.
//!
//! A last row runs `lqm-ts` with the context gate alone (`lqm.head.gate_tie_z = 0`: no
//! near-ties; the default has the gate on with near-ties and the warm-up by attempts,
//! docs/policies.md), under the same label and random streams as its default row.
//!
//! `cargo run --release -p equiroute-lab --example k10_floor [-- SEEDS [FIRST]]` (default 15
//! seeds from seed 1: 1..=15; `-- 20 16` runs 16..=35). Not a policy of the product: it knows
//! the scenario's structure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use equiroute_core::policies::{
    AttemptObservation, LqmTs, LqmTsConfig, Policy, PolicyKind, PolicyState, QualityObservation,
    RankContext, Ranking, ScoreBreakdown, ScoredCandidate,
};
use equiroute_core::StateError;
use equiroute_lab::report::Summary;
use equiroute_lab::runner::{run, run_policy, RunResult};
use equiroute_lab::scenario::builtin;
use rand::RngCore;
use rand_distr::{Distribution, StandardNormal};

/// Context-free Gaussian Thompson sampling on judged quality.
#[derive(Clone, Debug)]
struct MeanThompson {
    n: Vec<f64>,
    sum: Vec<f64>,
    sum_sq: Vec<f64>,
}

impl MeanThompson {
    fn new(k: usize) -> MeanThompson {
        MeanThompson {
            n: vec![0.0; k],
            sum: vec![0.0; k],
            sum_sq: vec![0.0; k],
        }
    }

    fn draw(&self, i: usize, rng: &mut dyn RngCore) -> f64 {
        let n = self.n[i];
        let mean = (self.sum[i] + 0.5) / (n + 1.0);
        let var = if n >= 2.0 {
            ((self.sum_sq[i] - self.sum[i] * self.sum[i] / n) / (n - 1.0)).max(0.01)
        } else {
            0.25
        };
        let z: f64 = StandardNormal.sample(rng);
        mean + z * (var / (n + 1.0)).sqrt()
    }
}

impl Policy for MeanThompson {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Random
    }

    fn rank(&self, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> Ranking {
        let mut r = Ranking {
            order: ctx
                .eligible
                .iter()
                .map(|&i| ScoredCandidate {
                    index: i,
                    score: self.draw(i, rng),
                    breakdown: ScoreBreakdown::default(),
                })
                .collect(),
            propensity: None,
            ..Ranking::default()
        };
        r.order.sort_by(|a, b| b.score.total_cmp(&a.score));
        r
    }

    fn observe_attempt(&mut self, _obs: &AttemptObservation<'_>) {}

    fn observe_quality(&mut self, obs: &QualityObservation<'_>) {
        let i = obs.candidate;
        self.n[i] += 1.0;
        self.sum[i] += obs.quality;
        self.sum_sq[i] += obs.quality * obs.quality;
    }

    fn export_state(&self) -> PolicyState {
        PolicyState::Stateless {
            kind: PolicyKind::Random,
        }
    }

    fn merge_state(&mut self, _other: &PolicyState) -> Result<(), StateError> {
        Ok(())
    }
}

fn main() {
    let seeds: u64 = std::env::args().nth(1).map_or(15, |s| {
        s.parse()
            .ok()
            .filter(|&n| n > 0)
            .expect("SEEDS: a number of seeds of at least 1, e.g. 15")
    });
    let first: u64 = std::env::args()
        .nth(2)
        .map_or(1, |s| s.parse().expect("FIRST: the first seed, e.g. 16"));
    let range = first..first + seeds;
    let spec = builtin("priority-mismatch-k10").unwrap();
    let k = spec.providers.len();
    let rounds = spec.rounds;
    let mut rows: Vec<(&str, Vec<RunResult>)> = Vec::new();
    for label in ["priority-tuned", "lqm-ts", "lqm"] {
        let runs = range
            .clone()
            .map(|s| run(&spec, label, s, rounds).unwrap())
            .collect();
        rows.push((label, runs));
    }
    let floor = range
        .clone()
        .map(|s| {
            let p = Box::new(MeanThompson::new(k));
            run_policy(&spec, "mean-thompson", p, s, rounds).unwrap()
        })
        .collect();
    rows.push(("mean-thompson (told: no context)", floor));
    // lqm-ts with the context gate alone (no near-ties), under the same label and so the
    // same random streams as the default row.
    let mut gated = LqmTsConfig::default();
    gated.lqm.head.gate_tie_z = 0.0;
    let gated_runs = range
        .clone()
        .map(|s| {
            let p = Box::new(LqmTs::new(k, spec.feature_dim, gated));
            run_policy(&spec, "lqm-ts", p, s, rounds).unwrap()
        })
        .collect();
    rows.push(("lqm-ts, gate alone (lqm.head.gate_tie_z = 0)", gated_runs));
    println!(
        "priority-mismatch-k10, seeds {}..={}, {rounds} rounds; mean ± 95% CI over seeds",
        range.start,
        range.end - 1
    );
    println!();
    println!(
        "| policy | quality | within noise of the tuned order | regret | regret per seed | first choices per provider (mean over seeds) |"
    );
    println!("|---|---|---|---|---|---|");
    let quality =
        |runs: &[RunResult]| Summary::of(&runs.iter().map(|r| r.quality).collect::<Vec<_>>());
    // rows[0] is priority-tuned, the true order: the oracle here.
    let tuned = quality(&rows[0].1);
    for (label, runs) in &rows {
        let q = quality(runs);
        let g = Summary::of(&runs.iter().map(|r| r.regret).collect::<Vec<_>>());
        let pulls: Vec<String> = (0..k)
            .map(|i| {
                let mean = runs.iter().map(|r| r.share[i]).sum::<f64>() / runs.len() as f64;
                format!("{:.0}", mean * rounds as f64)
            })
            .collect();
        let per_seed: Vec<String> = runs.iter().map(|r| format!("{:.0}", r.regret)).collect();
        println!(
            "| {label} | {:.4} ± {:.4} | {} | {:.1} ± {:.1} | {} | {} |",
            q.mean,
            q.ci95,
            if q.within_noise_of(&tuned) {
                "yes"
            } else {
                "no"
            },
            g.mean,
            g.ci95,
            per_seed.join(" "),
            pulls.join(" / ")
        );
    }
    println!();
    println!("Mean cumulative regret at the end of every fourth of the run's time bins:");
    for (label, runs) in &rows {
        let bins = runs.first().map_or(0, |r| r.regret_over_time.len());
        let curve: Vec<String> = (0..bins)
            .step_by(4)
            .map(|b| {
                let m = runs.iter().map(|r| r.regret_over_time[b]).sum::<f64>() / runs.len() as f64;
                format!("{m:.1}")
            })
            .collect();
        println!("- {label}: {}", curve.join(" "));
    }
}
