//! Eligibility runs first and explains every exclusion.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

use equiroute_core::breaker::{Breaker, BreakerConfig};
use equiroute_core::eligibility::{
    check_eligibility, EligibilityInput, ExclusionReason, QualityGate, QualitySummary,
};
use equiroute_core::{Candidate, Price, Requirements, Timestamp, TokenEstimate, Usd};

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
