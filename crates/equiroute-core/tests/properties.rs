//! Properties that must hold for any input.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

mod common;

use equiroute_core::estimators::ewma::{FailureRate, FailureRateConfig};
use equiroute_core::estimators::linucb::{LinUcbConfig, LinUcbHead};
use equiroute_core::estimators::nig::LogLatencyStats;
use equiroute_core::policies::*;
use equiroute_core::*;
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const DIM: usize = 8;

/// One observation of a random stream.
#[derive(Clone, Debug)]
struct Event {
    candidate: usize,
    x: Vec<f64>,
    status: u8,
    latency: f64,
    quality: Option<f64>,
}

fn event(k: usize) -> impl Strategy<Value = Event> {
    (
        0..k,
        prop::collection::vec(-10.0f64..10.0, DIM),
        0u8..5,
        prop_oneof![0.0f64..5.0, 1.0f64..100_000.0],
        prop::option::of(0.0f64..=1.0),
    )
        .prop_map(|(candidate, x, status, latency, quality)| Event {
            candidate,
            x,
            status,
            latency,
            quality,
        })
}

fn status(code: u8) -> AttemptStatus {
    match code {
        0 | 1 => AttemptStatus::Ok,
        2 => AttemptStatus::ProviderError(ProviderFailure::RateLimited),
        3 => AttemptStatus::Timeout,
        _ => AttemptStatus::ClientError,
    }
}

fn feed(p: &mut dyn Policy, events: &[Event]) {
    for (t, e) in events.iter().enumerate() {
        let now = t as f64 * 37.0;
        common::attempt_in(
            p,
            e.candidate,
            &e.x,
            status(e.status),
            e.latency,
            now,
            SlicePath::root(),
            Some(Millis(2000.0)),
        );
        if let (Some(q), 0 | 1) = (e.quality, e.status) {
            p.observe_quality(&QualityObservation {
                candidate: e.candidate,
                features: &e.x,
                quality: q,
                latency: Millis(e.latency),
                now: Timestamp(now),
            });
        }
    }
}

fn pool(k: usize) -> Vec<Candidate> {
    (0..k)
        .map(|i| {
            Candidate::new(&format!("c{i}"), "p", "m").with_price(Price::per_call(0.001 * i as f64))
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn rankings_are_permutations_of_the_eligible_set_with_finite_scores(
        events in prop::collection::vec(event(4), 0..60),
        mask in prop::collection::vec(any::<bool>(), 4),
        probe in prop::collection::vec(-100.0f64..100.0, DIM),
        deadline in prop::option::of(1.0f64..20_000.0),
        seed in any::<u64>(),
    ) {
        let cands = pool(4);
        let eligible: Vec<usize> = (0..4).filter(|&i| mask[i]).collect();
        for kind in PolicyKind::ALL {
            let mut p = PolicyConfig::default_for(kind).build(&cands, DIM).unwrap();
            feed(p.as_mut(), &events);
            let in_flight = [3, 1, 0, 2];
            let truth = [0.1, 0.7, 0.3, 0.5];
            let mut ctx = RankContext::new(&cands, &eligible, &probe);
            ctx.deadline = deadline.map(Millis);
            ctx.now = Timestamp(events.len() as f64 * 37.0);
            ctx.in_flight = Some(&in_flight);
            ctx.oracle_values = Some(&truth);
            let r = p.rank(&ctx, &mut ChaCha8Rng::seed_from_u64(seed));
            let mut got: Vec<usize> = r.indices().collect();
            got.sort_unstable();
            prop_assert_eq!(&got, &eligible, "{} is not a permutation", kind);
            for s in &r.order {
                prop_assert!(s.score.is_finite(), "{}: score {}", kind, s.score);
            }
            if let Some(pr) = r.first_choice_probability() {
                prop_assert!((0.0..=1.0).contains(&pr));
            }
        }
    }

    #[test]
    fn every_policy_reports_a_first_choice_distribution_over_the_eligible_set(
        events in prop::collection::vec(event(4), 0..60),
        mask in prop::collection::vec(any::<bool>(), 4),
        probe in prop::collection::vec(-100.0f64..100.0, DIM),
        deadline in prop::option::of(1.0f64..20_000.0),
        seed in any::<u64>(),
    ) {
        let cands = pool(4);
        let eligible: Vec<usize> = (0..4).filter(|&i| mask[i]).collect();
        for kind in PolicyKind::ALL {
            let mut p = PolicyConfig::default_for(kind).build(&cands, DIM).unwrap();
            feed(p.as_mut(), &events);
            let in_flight = [3, 1, 0, 2];
            let truth = [0.1, 0.7, 0.3, 0.5];
            let mut ctx = RankContext::new(&cands, &eligible, &probe);
            ctx.deadline = deadline.map(Millis);
            ctx.now = Timestamp(events.len() as f64 * 37.0);
            ctx.in_flight = Some(&in_flight);
            ctx.oracle_values = Some(&truth);
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let fc = p.first_choice_distribution(&ctx, &mut rng, 16);
            prop_assert_eq!(fc.probabilities.len(), 4);
            let total: f64 = eligible.iter().map(|&i| fc.probabilities[i]).sum();
            let want = if eligible.is_empty() { 0.0 } else { 1.0 };
            prop_assert!((total - want).abs() < 1e-9, "{}: sums to {}", kind, total);
            for i in (0..4).filter(|i| !eligible.contains(i)) {
                prop_assert!(fc.probabilities[i].abs() < 1e-15, "{}: ineligible {} has mass", kind, i);
            }
            // Every policy but the random, least-busy and Thompson ones says it is
            // deterministic (an evaluator refuses logs of those alone).
            let stochastic = matches!(
                kind,
                PolicyKind::Random | PolicyKind::LeastBusy | PolicyKind::TsDeadline | PolicyKind::LqmTs
            );
            if !eligible.is_empty() {
                prop_assert_eq!(fc.kind == PropensityKind::Deterministic, !stochastic, "{}", kind);
            }
            // A deterministic policy's distribution is its ranking's first choice.
            if fc.kind == PropensityKind::Deterministic && !eligible.is_empty() {
                let first = p.rank(&ctx, &mut rng).order[0].index;
                prop_assert!((fc.probabilities[first] - 1.0).abs() < 1e-15, "{}: {:?} vs {}", kind, fc, first);
            }
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_decisions(
        events in prop::collection::vec(event(3), 0..40),
        seed in any::<u64>(),
    ) {
        let cands = pool(3);
        let x = [0.3; DIM];
        for kind in PolicyKind::ALL {
            let decide = || {
                let mut p = PolicyConfig::default_for(kind).build(&cands, DIM).unwrap();
                feed(p.as_mut(), &events);
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let mut ctx = RankContext::new(&cands, &[0, 1, 2], &x);
                ctx.deadline = Some(Millis(1500.0));
                (0..5).map(|_| p.rank(&ctx, &mut rng)).collect::<Vec<_>>()
            };
            prop_assert_eq!(decide(), decide(), "{}", kind);
        }
    }

    #[test]
    fn lqm_quality_term_vanishes_with_quality_whatever_the_latency(
        latency in 0.0f64..1e7,
        quality in 0.0f64..1e-3,
        n in 1usize..30,
    ) {
        let cands = pool(1);
        let mut lqm = Lqm::new(1, DIM, LqmConfig::default());
        let x = [1.0 / (DIM as f64).sqrt(); DIM];
        for t in 0..n {
            common::answered(&mut lqm, 0, &x, latency * 1e-6, quality, t as f64);
        }
        let r = lqm.rank(&RankContext::new(&cands, &[0], &x), &mut ChaCha8Rng::seed_from_u64(0));
        let s = r.order[0];
        let term = s.score - s.breakdown.exploration.unwrap();
        // û/(1+τ̂/L) ≤ û ≤ the largest quality seen: a near-useless provider's term is near 0.
        prop_assert!(term.abs() <= quality + 1e-12, "term {} for quality {}", term, quality);
    }

    #[test]
    fn merged_statistics_equal_statistics_of_the_concatenated_stream(
        latencies in prop::collection::vec((1.0f64..50_000.0, any::<bool>(), 0.0f64..10_000.0), 1..80),
        split in 0usize..80,
    ) {
        let hl = Some(5_000.0);
        let cfg = FailureRateConfig { half_life_ms: hl, ..FailureRateConfig::default() };
        let mut times: Vec<f64> = latencies.iter().map(|l| l.2).collect();
        times.sort_by(f64::total_cmp);
        let (mut all, mut left, mut right) = (LogLatencyStats::default(), LogLatencyStats::default(), LogLatencyStats::default());
        let (mut fa, mut fl, mut fr) = (FailureRate::default(), FailureRate::default(), FailureRate::default());
        let mut heads = [LinUcbHead::new(3, LinUcbConfig { window: None, ..LinUcbConfig::default() }), LinUcbHead::new(3, LinUcbConfig { window: None, ..LinUcbConfig::default() }), LinUcbHead::new(3, LinUcbConfig { window: None, ..LinUcbConfig::default() })];
        for (i, ((l, failed, _), t)) in latencies.iter().zip(&times).enumerate() {
            let now = Timestamp(*t);
            let side = usize::from(i >= split);
            all.observe(now, *l, hl);
            fa.record(now, *failed, &cfg);
            let x = [l.ln() / 10.0, 1.0, if *failed { 1.0 } else { -1.0 }];
            heads[0].update(&x, l / 50_000.0, now);
            if side == 0 { left.observe(now, *l, hl); fl.record(now, *failed, &cfg); } else { right.observe(now, *l, hl); fr.record(now, *failed, &cfg); }
            heads[1 + side].update(&x, l / 50_000.0, now);
        }
        left.merge(&right, hl);
        fl.merge(&fr, &cfg);
        let [h_all, mut h_left, h_right] = heads;
        h_left.merge(&h_right).unwrap();
        let rel = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0);
        prop_assert_eq!(left.count, all.count);
        prop_assert!(rel(left.weight, all.weight), "{} {}", left.weight, all.weight);
        prop_assert!(rel(left.mean_log, all.mean_log));
        prop_assert!(rel(left.deviation_sum, all.deviation_sum), "{} {}", left.deviation_sum, all.deviation_sum);
        prop_assert_eq!(fl.count, fa.count);
        prop_assert!(rel(fl.failures, fa.failures) && rel(fl.attempts, fa.attempts));
        for (a, b) in h_left.a().iter().zip(&h_all.a()) { prop_assert!(rel(*a, *b)); }
        for (a, b) in h_left.b().iter().zip(h_all.b()) { prop_assert!(rel(*a, *b)); }
        prop_assert_eq!(h_left.count(), h_all.count());
    }

    #[test]
    fn policy_state_merges_like_one_instance_that_saw_everything(
        events in prop::collection::vec(event(3), 1..50),
        split in 0usize..50,
    ) {
        // ts-deadline and lqm-ts statistics, split across two instances, then merged.
        let cands = pool(3);
        for kind in [PolicyKind::TsDeadline, PolicyKind::LqmTs] {
            let build = || PolicyConfig::default_for(kind).build(&cands, DIM).unwrap();
            let (mut one, mut a, mut b) = (build(), build(), build());
            feed(one.as_mut(), &events);
            let cut = split.min(events.len());
            feed(a.as_mut(), &events[..cut]);
            // The second instance sees the later events at their original times.
            for (t, e) in events.iter().enumerate().skip(cut) {
                common::attempt_in(b.as_mut(), e.candidate, &e.x, status(e.status), e.latency, t as f64 * 37.0, SlicePath::root(), Some(Millis(2000.0)));
            }
            a.merge_state(&b.export_state()).unwrap();
            let (PolicyState::TsDeadline(m) | PolicyState::LqmTs(LqmTsState { risk: m, .. })) = a.export_state() else { unreachable!() };
            let (PolicyState::TsDeadline(o) | PolicyState::LqmTs(LqmTsState { risk: o, .. })) = one.export_state() else { unreachable!() };
            prop_assert_eq!(m.slices.len(), o.slices.len());
            for (p, q) in m.failures.iter().zip(&o.failures) {
                prop_assert_eq!(p.count, q.count);
                prop_assert!((p.failures - q.failures).abs() < 1e-9 && (p.attempts - q.attempts).abs() < 1e-9);
            }
            for (p, q) in m.slices.iter().zip(&o.slices) {
                prop_assert_eq!(p.stats.count, q.stats.count);
                prop_assert!((p.stats.weight - q.stats.weight).abs() < 1e-9 * q.stats.weight.max(1.0));
            }
        }
    }
}
