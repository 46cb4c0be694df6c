//! Eligibility runs first and explains every exclusion.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

use equiroute_core::breaker::{Admission, Breaker, BreakerConfig, Transition};
use equiroute_core::eligibility::{
    check_eligibility, EligibilityInput, ExclusionReason, QualityGate, QualitySummary,
};
use equiroute_core::{
    AttemptOutcome, AttemptStatus, Candidate, Price, ProviderFailure, Requirements, Timestamp,
    TokenEstimate, Usd,
};

fn pool() -> Vec<Candidate> {
    let mut c: Vec<Candidate> = (0..6)
        .map(|i| Candidate::new(&format!("c{i}"), "p", "m"))
        .collect();
    c[1].capabilities.tools = false;
    c[2].capabilities.context_tokens = 8_000;
    c[3].tenants = Some(vec!["acme".into()]);
    c[4].labels.insert("region".into(), "us".into());
    c[5].price = Price {
        per_million_input_tokens: Usd(10.0),
        ..Price::default()
    };
    for x in &mut c {
        if x.id.0 != "c4" {
            x.labels.insert("region".into(), "eu".into());
        }
    }
    c
}

#[test]
fn each_filter_excludes_with_its_reason() {
    let cands = pool();
    let req = Requirements {
        tools: true,
        context_tokens: 32_000,
        ..Requirements::default()
    };
    let labels = vec![("region".to_owned(), "eu".to_owned())];
    let mut input = EligibilityInput::new(&cands, &req);
    input.tenant = Some("globex");
    input.required_labels = &labels;
    input.max_cost = Some(Usd(0.1));
    input.tokens = TokenEstimate {
        input: 20_000,
        output: 0,
    };
    let out = check_eligibility(&input);
    assert_eq!(out.eligible, vec![0]);
    let reasons: Vec<(usize, String)> = out
        .excluded
        .iter()
        .map(|e| (e.candidate, e.reason.to_string()))
        .collect();
    assert_eq!(reasons.len(), 5);
    assert!(matches!(
        out.excluded[0].reason,
        ExclusionReason::MissingCapability { .. }
    ));
    assert_eq!(reasons[0], (1, "does not support tools".into()));
    assert_eq!(
        reasons[1],
        (2, "context window 8000 tokens < 32000 needed".into())
    );
    assert_eq!(
        reasons[2],
        (3, "tenant `globex` is not on its allow-list".into())
    );
    assert_eq!(
        reasons[3],
        (
            4,
            "label `region` is `us` but the request needs `eu`".into()
        )
    );
    // 20k input tokens at $10 per million = $0.2 > $0.1.
    assert!(
        reasons[4].1.contains("expected cost $0.200000"),
        "{:?}",
        reasons[4]
    );
}

#[test]
fn a_request_without_a_tenant_is_not_served_by_a_tenant_restricted_candidate() {
    let cands = pool();
    let req = Requirements::default();
    let mut input = EligibilityInput::new(&cands, &req);
    let out = check_eligibility(&input);
    assert_eq!(out.eligible, vec![0, 1, 2, 4, 5], "c3 serves only acme");
    assert_eq!(out.excluded.len(), 1);
    assert_eq!(out.excluded[0].candidate, 3);
    assert!(matches!(
        out.excluded[0].reason,
        ExclusionReason::TenantRequired
    ));
    assert_eq!(
        out.excluded[0].reason.to_string(),
        "serves only the tenants on its allow-list and the request has none"
    );
    input.tenant = Some("acme");
    assert_eq!(check_eligibility(&input).eligible, vec![0, 1, 2, 3, 4, 5]);
}

#[test]
fn breakers_spend_caps_quality_gates_and_pins_exclude() {
    let mut cands = pool();
    cands[0].spend_cap = Some(Usd(5.0));
    let req = Requirements::default();
    let cfg = BreakerConfig::default();
    let mut breakers = vec![Breaker::default(); cands.len()];
    let _ = breakers[1].open(Timestamp(10_000.0));
    let spent = vec![Usd(5.0), Usd(0.0), Usd(0.0), Usd(0.0), Usd(0.0), Usd(0.0)];
    let quality = vec![
        QualitySummary::default(),
        QualitySummary::default(),
        QualitySummary {
            mean: 0.2,
            observations: 50,
        },
        QualitySummary {
            mean: 0.2,
            observations: 3,
        },
        QualitySummary::default(),
        QualitySummary::default(),
    ];
    let mut input = EligibilityInput::new(&cands, &req);
    // c3 serves only `acme`.
    input.tenant = Some("acme");
    input.breakers = Some((&breakers, &cfg));
    input.spent = Some(&spent);
    input.quality = Some((
        &quality,
        QualityGate {
            min_quality: 0.5,
            min_observations: 20,
        },
    ));
    input.now = Timestamp(5_000.0);
    let out = check_eligibility(&input);
    assert_eq!(
        out.eligible,
        vec![3, 4, 5],
        "too few observations do not trip the gate"
    );
    assert!(matches!(
        out.excluded[0].reason,
        ExclusionReason::SpendCap { .. }
    ));
    assert!(
        matches!(out.excluded[1].reason, ExclusionReason::CircuitOpen { until: Some(Timestamp(t)) } if (t - 10_000.0).abs() < 1e-9)
    );
    assert!(matches!(
        out.excluded[2].reason,
        ExclusionReason::QualityGate { .. }
    ));
    // After the open period the breaker admits a probe again.
    input.now = Timestamp(10_000.0);
    assert!(check_eligibility(&input).eligible.contains(&1));
    // Pinning keeps one candidate.
    input.pinned = Some(4);
    let out = check_eligibility(&input);
    assert_eq!(out.eligible, vec![4]);
    assert_eq!(out.excluded.len(), 5);
}

#[test]
fn with_every_candidate_tripped_the_one_reopening_soonest_is_the_last_resort() {
    let cands = pool();
    let req = Requirements::default();
    let cfg = BreakerConfig {
        consecutive_failures: 1,
        ..BreakerConfig::default()
    };
    // Candidate 0 lacks nothing but is pinned by a Retry-After ending first (at 2 s);
    // 1..=5 were tripped by failures, 3 at t = 0 (open until 5 s), the others later.
    let mut breakers = vec![Breaker::default(); cands.len()];
    let _ = breakers[0].open(Timestamp(2_000.0));
    let failure =
        AttemptOutcome::with_status(10.0, AttemptStatus::ProviderError(ProviderFailure::Server));
    for (i, at) in [(1, 900.0), (2, 500.0), (3, 0.0), (4, 700.0), (5, 300.0)] {
        let _ = breakers[i].observe(Timestamp(at), &failure, &cfg);
        assert!(!breakers[i].is_pinned());
    }
    assert!(breakers[0].is_pinned());
    let mut input = EligibilityInput::new(&cands, &req);
    // c3 serves only `acme`.
    input.tenant = Some("acme");
    input.breakers = Some((&breakers, &cfg));
    input.now = Timestamp(1_000.0);
    let out = check_eligibility(&input);
    assert!(out.eligible.is_empty());
    // Not 0 (its period ends first, but the provider set it): 3, open until 5 000 ms.
    assert_eq!(out.last_resort(&breakers, &cfg), Some(3));
    let mut rescued = breakers[3];
    assert_eq!(rescued.last_resort(), Some(Transition::HalfOpened));
    assert_eq!(rescued.admit(Timestamp(1_000.0), &cfg).0, Admission::Probe);
    // A pinned breaker is never ended early; the knob turns the rule off.
    let mut pinned = breakers[0];
    assert_eq!(pinned.last_resort(), None);
    let off = BreakerConfig {
        last_resort: false,
        ..cfg
    };
    assert_eq!(out.last_resort(&breakers, &off), None);
    // Once a period is over its candidate is eligible again: no last resort.
    input.now = Timestamp(5_000.0);
    let out = check_eligibility(&input);
    assert_eq!(out.eligible, vec![0, 3]);
    assert_eq!(out.last_resort(&breakers, &cfg), None);
}
