//! Cross-checks against independent implementations: `scripts/gen_fixtures.py` computes the
//! reference values with numpy/scipy (direct formulas, batch sums, explicit matrix inverses);
//! the Rust incremental implementations must agree to 1e-9.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

use equiroute_core::estimators::dist::lognormal_exceedance;
use equiroute_core::estimators::linucb::{LinUcbConfig, WarmupOrder};
use equiroute_core::estimators::nig::{LogLatencyStats, NigPosterior, NigPrior};
use equiroute_core::policies::{
    AttemptObservation, Lqm, LqmConfig, Policy, PolicyState, QualityObservation, RankContext,
};
use equiroute_core::{AttemptOutcome, Millis, SlicePath, Timestamp};
use rand::SeedableRng;
use serde_json::Value;

fn load(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(f).collect()
}

/// Relative difference, with an absolute floor so values near zero compare sensibly.
fn close(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= tol * want.abs().max(1.0)
}

#[test]
fn nig_posterior_matches_numpy() {
    let fx = load("nig.json");
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let p = &case["prior"];
        let prior = NigPrior {
            mu0: f(&p["mu0"]),
            kappa0: f(&p["kappa0"]),
            alpha0: f(&p["alpha0"]),
            beta0: f(&p["beta0"]),
        };
        let stats = LogLatencyStats::from_latencies(&floats(&case["latencies_ms"]));
        let post = stats.posterior(&prior);
        let e = &case["expected"];
        assert_eq!(stats.count, e["n"].as_u64().unwrap(), "{name}: n");
        for (what, got, want) in [
            ("mean_log", stats.mean_log, f(&e["mean_log"])),
            ("deviation_sum", stats.deviation_sum, f(&e["deviation_sum"])),
            ("kappa_n", post.kappa_n, f(&e["kappa_n"])),
            ("mu_n", post.mu_n, f(&e["mu_n"])),
            ("alpha_n", post.alpha_n, f(&e["alpha_n"])),
            ("beta_n", post.beta_n, f(&e["beta_n"])),
        ] {
            assert!(
                close(got, want, 1e-9),
                "{name}: {what} = {got}, numpy says {want}"
            );
        }
    }
}

#[test]
fn lognormal_tail_matches_scipy() {
    let fx = load("lognormal_tail.json");
    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 60);
    for c in cases {
        let (mu, sigma, d) = (f(&c["mu"]), f(&c["sigma"]), f(&c["deadline_ms"]));
        let want = f(&c["p_exceed"]);
        let got = lognormal_exceedance(mu, sigma, d);
        // Absolute 1e-9 everywhere; relative 1e-9 where the probability is not tiny.
        assert!(
            (got - want).abs() < 1e-9,
            "mu={mu} sigma={sigma} d={d}: {got} vs {want}"
        );
        if want > 1e-6 {
            assert!(
                ((got - want) / want).abs() < 1e-9,
                "relative: {got} vs {want}"
            );
        }
    }
    for c in fx["invgamma_normal_cases"].as_array().unwrap() {
        let post = NigPosterior {
            mu_n: f(&c["mu_n"]),
            kappa_n: f(&c["kappa"]),
            alpha_n: f(&c["alpha"]),
            beta_n: f(&c["beta"]),
        };
        assert!(close(post.mean_sigma2(), f(&c["mean_sigma2"]), 1e-12));
    }
}

#[test]
fn lqm_scores_on_a_fixed_stream_match_direct_inverses() {
    // Exact widths: every score to 1e-9.
    check_lqm_stream(false, 1e-9);
}

#[test]
fn lqm_single_precision_widths_stay_within_1e_6_of_the_reference() {
    check_lqm_stream(true, 1e-6);
}

/// Replays the fixture stream into LQM and compares state and scores at every checkpoint;
/// `score_tol` applies to the exploration bonus and the score (the state is always 1e-9).
fn check_lqm_stream(fast_width: bool, score_tol: f64) {
    let fx = load("linucb.json");
    let d = fx["d"].as_u64().unwrap() as usize;
    let k = fx["k"].as_u64().unwrap() as usize;
    let cfg = LqmConfig {
        alpha_ucb: f(&fx["alpha_ucb"]),
        shrink_lambda: f(&fx["shrink_lambda"]),
        l_ref_ms: f(&fx["l_ref_ms"]),
        ema_beta: f(&fx["ema_beta"]),
        tau0_ms: Some(f(&fx["tau0_ms"])),
        head: LinUcbConfig {
            lambda_r: f(&fx["lambda_r"]),
            window: Some(fx["window"].as_u64().unwrap() as usize),
            refresh_every: 1024,
            fast_width,
            // The paper has no warm-up: the reference scores rank every arm from step 1.
            warmup: 0,
            center: false,
            warmup_exit_z: 0.0,
            gate: false,
            gate_margin: 0.0,
            gate_z: 2.0,
            gate_retry: 0.0,
            gate_tie_z: 0.0,
            warmup_order: WarmupOrder::Scores,
        },
        failure_quality: None,
    };
    let mut lqm = Lqm::new(k, d, cfg);
    let candidates: Vec<_> = (0..k)
        .map(|i| equiroute_core::Candidate::new(&format!("arm{i}"), "p", "m"))
        .collect();
    let eligible: Vec<usize> = (0..k).collect();
    let probes: Vec<Vec<f64>> = fx["probes"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    let stream = fx["stream"].as_array().unwrap();
    let mut checkpoints = fx["checkpoints"].as_array().unwrap().iter().peekable();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut checked = 0;
    for (step, s) in stream.iter().enumerate() {
        let arm = s["arm"].as_u64().unwrap() as usize;
        let x = floats(&s["x"]);
        let latency = f(&s["latency_ms"]);
        let now = Timestamp(step as f64);
        let outcome = AttemptOutcome::ok(latency);
        lqm.observe_attempt(&AttemptObservation {
            candidate: arm,
            features: &x,
            slice: SlicePath::root(),
            deadline: None,
            outcome: &outcome,
            now,
        });
        lqm.observe_quality(&QualityObservation {
            candidate: arm,
            features: &x,
            quality: f(&s["u"]),
            latency: Millis(latency),
            now,
        });
        let Some(cp) = checkpoints.next_if(|c| c["after_step"].as_u64() == Some(step as u64 + 1))
        else {
            continue;
        };
        let PolicyState::Lqm(state) = lqm.export_state() else {
            panic!("lqm exports lqm state")
        };
        for (i, arm_fx) in cp["arms"].as_array().unwrap().iter().enumerate() {
            let tau = state.latency[i].value_ms;
            assert!(
                close(tau, f(&arm_fx["tau_hat"]), 1e-9),
                "step {step} arm {i} tau"
            );
            for (got, want) in state.heads.heads[i]
                .a_inv()
                .iter()
                .zip(floats(&arm_fx["a_inv"]))
            {
                assert!(
                    close(*got, want, 1e-9),
                    "step {step} arm {i} A⁻¹: {got} vs {want}"
                );
            }
        }
        for (probe, pfx) in probes.iter().zip(cp["probes"].as_array().unwrap()) {
            let ctx = RankContext::new(&candidates, &eligible, probe);
            let ranking = lqm.rank(&ctx, &mut rng);
            let (u_hat, width, delta, score) = (
                floats(&pfx["u_hat"]),
                floats(&pfx["width"]),
                floats(&pfx["delta"]),
                floats(&pfx["score"]),
            );
            for sc in &ranking.order {
                let i = sc.index;
                let b = sc.breakdown;
                assert!(
                    close(b.quality.unwrap(), u_hat[i], 1e-9),
                    "step {step} û[{i}]"
                );
                // The breakdown carries the shrunk bonus width/(1+λΔ).
                let bonus = width[i] / (1.0 + cfg.shrink_lambda * delta[i]);
                assert!(
                    close(b.exploration.unwrap(), bonus, score_tol),
                    "step {step} bonus[{i}]"
                );
                assert!(
                    close(sc.score, score[i], score_tol),
                    "step {step} score[{i}]: {} vs {}",
                    sc.score,
                    score[i]
                );
            }
            // And the order is the descending order of the reference scores.
            let mut want: Vec<usize> = (0..k).collect();
            want.sort_by(|a, b| score[*b].total_cmp(&score[*a]));
            assert_eq!(ranking.indices().collect::<Vec<_>>(), want, "step {step}");
        }
        checked += 1;
    }
    assert_eq!(checked, 8, "every checkpoint was compared");
}
