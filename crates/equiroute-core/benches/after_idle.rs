//! The router's decision after the thread has been idle: featurize + `lqm-ts` rank +
//! attempt update for K = 3 candidates (the gateway benchmark's set) and d = 64, timed one
//! call at a time, back to back and after sleeping 1 ms and 20 ms between calls (a gateway at
//! concurrency 1 in front of a 20 ms upstream sleeps that long between requests).
//!
//! It separates what the code costs from what the machine charges for waking up: the same
//! instructions take longer when the caches and the core went cold during the sleep.
//! `POLICY=NAME` (e.g. `ts-deadline`, `lqm`) times that policy instead of `lqm-ts`.
//! Not run by CI: `cargo bench -p equiroute-core --bench after_idle`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::cast_precision_loss)]

use equiroute_core::policies::{AttemptObservation, PolicyConfig, PolicyKind, RankContext};
use equiroute_core::prelude::Featurizer;
use equiroute_core::{AttemptOutcome, Candidate, Millis, Price, SlicePath, Timestamp};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::hint::black_box;
use std::time::{Duration, Instant};

const K: usize = 3;
const D: usize = 64;
const CALLS: usize = 400;

fn main() {
    let cands: Vec<Candidate> = (0..K)
        .map(|i| Candidate::new(&format!("c{i}"), "p", "m").with_price(Price::per_call(0.001)))
        .collect();
    let kind: PolicyKind = std::env::var("POLICY")
        .as_deref()
        .unwrap_or("lqm-ts")
        .parse()
        .unwrap_or_else(|e| panic!("POLICY: {e}"));
    let mut policy = PolicyConfig::default_for(kind).build(&cands, D).unwrap();
    let featurizer = Featurizer::new(D).unwrap();
    let eligible: Vec<usize> = (0..K).collect();
    let slice = SlicePath::default();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut t = 0.0;
    let mut one = |i: usize| -> Duration {
        let started = Instant::now();
        let x = featurizer.featurize(black_box("hello"));
        let ranking = {
            let mut ctx = RankContext::new(&cands, &eligible, &x);
            ctx.deadline = Some(Millis(10_000.0));
            ctx.now = Timestamp(t);
            policy.rank(&ctx, &mut rng)
        };
        let first = ranking.order[0].index;
        let outcome = AttemptOutcome::ok(20.0 + (i % 7) as f64);
        t += 21.0;
        policy.observe_attempt(&AttemptObservation {
            candidate: first,
            features: &x,
            slice,
            deadline: Some(Millis(10_000.0)),
            outcome: &outcome,
            now: Timestamp(t),
        });
        started.elapsed()
    };
    // Warm the policy's state (latency posteriors) first.
    for i in 0..2000 {
        black_box(one(i));
    }
    // A control that touches no memory: a chain of dependent multiply-adds in registers,
    // about as long as the decision when warm. If it also slows down after a sleep, the core
    // itself (its clock, or the hypervisor) is slow to come back, not just the caches.
    let spin = |_: usize| -> Duration {
        let started = Instant::now();
        let mut v = black_box(1.000_000_1_f64);
        for _ in 0..2_000 {
            v = v.mul_add(0.999_999_9, 1e-9);
        }
        black_box(v);
        started.elapsed()
    };
    // Two memory controls that read the same number of cache lines (64): packed into one
    // 4 KiB page, and one line in each of 64 pages. Whether a cold read costs by the line or
    // by the page tells the caches apart from the address translation (TLB, page walks).
    let pages = vec![1u8; 64 * 4096];
    let lines = |stride: usize| {
        let pages = &pages;
        move |_: usize| -> Duration {
            let started = Instant::now();
            let mut sum = 0u64;
            for k in 0..64 {
                sum += u64::from(black_box(pages[k * stride]));
            }
            black_box(sum);
            started.elapsed()
        }
    };
    println!(
        "featurize + {kind} rank + attempt update (K = {K}, d = {D}), and controls; {CALLS} calls each"
    );
    println!("| work | idle before each call | p50 µs | p90 µs | p99 µs | max µs |");
    println!("|---|---|---|---|---|---|");
    let row = |work: &str, label: &str, gap: Duration, f: &mut dyn FnMut(usize) -> Duration| {
        let mut us: Vec<f64> = (0..CALLS)
            .map(|i| {
                if !gap.is_zero() {
                    std::thread::sleep(gap);
                }
                f(i).as_secs_f64() * 1e6
            })
            .collect();
        us.sort_by(f64::total_cmp);
        let q = |p: f64| us[((us.len() as f64 - 1.0) * p).round() as usize];
        println!(
            "| {work} | {label} | {:.1} | {:.1} | {:.1} | {:.1} |",
            q(0.5),
            q(0.9),
            q(0.99),
            q(1.0)
        );
    };
    for (label, gap) in [
        ("none (back to back)", Duration::ZERO),
        ("1 ms", Duration::from_millis(1)),
        ("20 ms", Duration::from_millis(20)),
    ] {
        row("router", label, gap, &mut one);
        row("control: registers only", label, gap, &mut { spin });
        row("control: 64 lines in 1 page", label, gap, &mut lines(64));
        row(
            "control: 64 lines in 64 pages",
            label,
            gap,
            &mut lines(4096),
        );
    }
}
