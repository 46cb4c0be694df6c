//! Helpers shared by the integration tests: feeding observations without boilerplate.
#![allow(dead_code)]

use equiroute_core::policies::{AttemptObservation, Policy, QualityObservation};
use equiroute_core::{AttemptOutcome, AttemptStatus, Millis, SlicePath, Timestamp};

/// Feeds one attempt with the given status and latency.
pub fn attempt(
    p: &mut dyn Policy,
    candidate: usize,
    x: &[f64],
    status: AttemptStatus,
    latency_ms: f64,
    now_ms: f64,
) {
    attempt_in(
        p,
        candidate,
        x,
        status,
        latency_ms,
        now_ms,
        SlicePath::root(),
        None,
    );
}

/// Feeds one attempt in a slice, with a deadline.
#[allow(clippy::too_many_arguments)]
pub fn attempt_in(
    p: &mut dyn Policy,
    candidate: usize,
    x: &[f64],
    status: AttemptStatus,
    latency_ms: f64,
    now_ms: f64,
    slice: SlicePath,
    deadline: Option<Millis>,
) {
    let outcome = AttemptOutcome::with_status(latency_ms, status);
    p.observe_attempt(&AttemptObservation {
        candidate,
        features: x,
        slice,
        deadline,
        outcome: &outcome,
        now: Timestamp(now_ms),
    });
}

/// Feeds a successful attempt followed by its quality score.
pub fn answered(
    p: &mut dyn Policy,
    candidate: usize,
    x: &[f64],
    latency_ms: f64,
    quality: f64,
    now_ms: f64,
) {
    attempt(p, candidate, x, AttemptStatus::Ok, latency_ms, now_ms);
    p.observe_quality(&QualityObservation {
        candidate,
        features: x,
        quality,
        latency: Millis(latency_ms),
        now: Timestamp(now_ms),
    });
}

/// Some varied queries.
pub fn queries() -> Vec<String> {
    let topics = [
        "rust", "python", "weather", "football", "tax", "recipe", "flight", "history",
    ];
    let asks = [
        "latest news on",
        "how to learn",
        "best sources for",
        "explain",
        "compare",
    ];
    let mut out = Vec::new();
    for t in topics {
        for a in asks {
            out.push(format!("{a} {t} in 2026"));
        }
    }
    out
}
