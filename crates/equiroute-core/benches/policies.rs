//! Decision and update cost with K = 10 candidates and d = 64 features (the bar:
//! ≤ 5 µs median each), the cost of a first-choice distribution (propensities for off-policy
//! evaluation) and of a ranking behind an exploration floor. Not run by CI:
//! `cargo bench -p equiroute-core --bench policies`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use equiroute_core::policies::{
    AttemptObservation, ExplorationFloor, ExplorationFloorConfig, Policy, PolicyConfig, PolicyKind,
    QualityObservation, RankContext,
};
use equiroute_core::prelude::Featurizer;
use equiroute_core::{
    AttemptOutcome, AttemptStatus, Candidate, Millis, Price, SliceLabels, SlicePath, Timestamp,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const K: usize = 10;
const D: usize = 64;

fn setup(
    kind: PolicyKind,
) -> (
    Box<dyn equiroute_core::policies::Policy>,
    Vec<Candidate>,
    Vec<Vec<f64>>,
    SlicePath,
) {
    let cands: Vec<Candidate> = (0..K)
        .map(|i| {
            Candidate::new(&format!("c{i}"), "p", "m")
                .with_price(Price::per_call(0.001 * (i + 1) as f64))
        })
        .collect();
    let mut p = PolicyConfig::default_for(kind).build(&cands, D).unwrap();
    let f = Featurizer::new(D).unwrap();
    let xs: Vec<Vec<f64>> = (0..256)
        .map(|i| f.featurize(&format!("query number {i} about topic {}", i % 17)))
        .collect();
    let slice = SlicePath::from_labels(
        &SliceLabels {
            task_class: Some("chat".into()),
            deadline_class: Some("<5s".into()),
            streaming: true,
            input_bucket: Some(1),
        },
        4,
    );
    let mut r = ChaCha8Rng::seed_from_u64(1);
    // Warm state: a full window of quality (W = 2000 per head) and latency history.
    for t in 0..(K * 2100) {
        let i = t % K;
        let x = &xs[t % xs.len()];
        let outcome = AttemptOutcome::ok(100.0 + 50.0 * i as f64 + r.random::<f64>() * 100.0);
        let now = Timestamp(t as f64);
        p.observe_attempt(&AttemptObservation {
            candidate: i,
            features: x,
            slice,
            deadline: Some(Millis(2000.0)),
            outcome: &outcome,
            now,
        });
        p.observe_quality(&QualityObservation {
            candidate: i,
            features: x,
            quality: r.random(),
            latency: outcome.latency,
            now,
        });
    }
    (p, cands, xs, slice)
}

fn bench(c: &mut Criterion) {
    let eligible: Vec<usize> = (0..K).collect();
    for kind in [PolicyKind::Lqm, PolicyKind::TsDeadline, PolicyKind::LqmTs] {
        let (mut p, cands, xs, slice) = setup(kind);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut n = 0usize;
        c.bench_function(&format!("rank/{kind}/k10_d64"), |b| {
            b.iter(|| {
                n += 1;
                let mut ctx = RankContext::new(&cands, &eligible, &xs[n % xs.len()]);
                ctx.deadline = Some(Millis(2000.0));
                ctx.slice = slice;
                ctx.now = Timestamp(30_000.0);
                black_box(p.rank(&ctx, &mut rng))
            });
        });
        // The propensity's cost: a Thompson policy's first-choice distribution from `draws`
        // rankings (the deterministic ones cost one ranking), and a ranking behind a floor.
        let draw_counts: &[u32] = if kind == PolicyKind::Lqm {
            &[1]
        } else {
            &[16, 100]
        };
        for &draws in draw_counts {
            c.bench_function(&format!("first_choice/{kind}/draws{draws}"), |b| {
                b.iter(|| {
                    n += 1;
                    let mut ctx = RankContext::new(&cands, &eligible, &xs[n % xs.len()]);
                    ctx.deadline = Some(Millis(2000.0));
                    ctx.slice = slice;
                    ctx.now = Timestamp(30_000.0);
                    black_box(p.first_choice_distribution(&ctx, &mut rng, draws))
                });
            });
        }
        let floored =
            ExplorationFloor::new(p.clone_box(), ExplorationFloorConfig::new(0.01)).unwrap();
        c.bench_function(&format!("rank/{kind}+floor0.01/k10_d64"), |b| {
            b.iter(|| {
                n += 1;
                let mut ctx = RankContext::new(&cands, &eligible, &xs[n % xs.len()]);
                ctx.deadline = Some(Millis(2000.0));
                ctx.slice = slice;
                ctx.now = Timestamp(30_000.0);
                black_box(floored.rank(&ctx, &mut rng))
            });
        });
        let mut t = 40_000.0;
        c.bench_function(&format!("update/{kind}/attempt_and_quality"), |b| {
            b.iter(|| {
                n += 1;
                t += 1.0;
                let i = n % K;
                let x = &xs[n % xs.len()];
                let status = if n.is_multiple_of(20) {
                    AttemptStatus::Timeout
                } else {
                    AttemptStatus::Ok
                };
                let outcome = AttemptOutcome::with_status(150.0 + (n % 7) as f64 * 30.0, status);
                let now = Timestamp(t);
                p.observe_attempt(&AttemptObservation {
                    candidate: i,
                    features: x,
                    slice,
                    deadline: Some(Millis(2000.0)),
                    outcome: &outcome,
                    now,
                });
                p.observe_quality(&QualityObservation {
                    candidate: i,
                    features: x,
                    quality: 0.5,
                    latency: outcome.latency,
                    now,
                });
            });
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
