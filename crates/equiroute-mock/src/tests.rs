//! The mock's own tests: profiles read and checked, latencies and fault mixes drawn as
//! written, calls counted per model, the recent requests bounded.

use crate::faults::{latency_of, mixed_fault};
use crate::profile::{Fault, MockProfile};
use crate::{Counters, MAX_COUNTED_MODELS, OTHER_MODELS};
use equiroute_core::latency::LatencyShapeSpec;
use rand::SeedableRng;

#[test]
fn a_profile_names_the_field_at_fault() {
    let err = |text: &str| MockProfile::from_toml(text, "m.toml").unwrap_err();
    let e = err("[chat]\nerror_500 = \"often\"\n");
    assert!(e.starts_with("m.toml: `chat.error_500`:"), "{e}");
    assert!(e.contains("line 2"), "{e}");
    let e = err("[search]\nlatency_ms = 5\n");
    assert!(
        e.contains("`search.latency_ms`") && e.contains("unknown field"),
        "{e}"
    );
    let e = err("[chat]\nerror_429 = 1.5\n");
    assert_eq!(
        e,
        "m.toml: `chat.error_429`: a probability from 0 to 1, got 1.5"
    );
    let e = err("[chat]\nerror_500 = 0.6\nerror_503 = 0.6\n");
    assert!(e.contains("must be at most 1, got 1.2"), "{e}");
    let e = err("[search]\nlatency = { p50_ms = 30, p95_ms = 10 }\n");
    assert!(
        e.starts_with("m.toml: `search.latency`: needs 0 < p50_ms ≤ p95_ms"),
        "{e}"
    );
    let e = err("[chat]\nretry_after_s = -1\n");
    assert!(e.contains("`chat.retry_after_s`"), "{e}");
    // A model's table is checked like a route, and names the model.
    let e = err("[models.\"m-1\"]\nfault = \"exploding\"\n");
    assert!(
        e.contains("`models.m-1.fault`") && e.contains("unknown variant"),
        "{e}"
    );
    let e = err("[models.m]\nfault = \"slow_first_token\"\nfirst_token_delay_ms = -5\n");
    assert_eq!(
        e,
        "m.toml: `models.m.first_token_delay_ms`: milliseconds ≥ 0, got -5"
    );
    let p = MockProfile::from_toml(
        "[chat]\nfault = \"unavailable\"\n[models.\"gpt-x\"]\nfault = \"flapping\"\n",
        "m.toml",
    )
    .unwrap();
    assert_eq!(p.chat_for(Some("gpt-x")).fault, Some(Fault::Flapping));
    assert_eq!(p.chat_for(Some("other")).fault, Some(Fault::Unavailable));
    // The throughput variant: no latency at all, and the defaults.
    let p =
        MockProfile::from_toml("[chat]\nlatency = { p50_ms = 0, p95_ms = 0 }\n", "m.toml").unwrap();
    assert_eq!(
        (&p.chat.latency, &p.search.latency),
        (
            &LatencyShapeSpec::log_normal(0.0, 0.0),
            &LatencyShapeSpec::log_normal(20.0, 20.0)
        )
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    assert_eq!(latency_of(&p.chat, &mut rng), std::time::Duration::ZERO);
}

/// The p-quantile (in ms) of `n` draws of the chat route's latency.
fn quantiles(profile: &MockProfile, n: usize, qs: &[f64]) -> Vec<f64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut v: Vec<f64> = (0..n)
        .map(|_| latency_of(&profile.chat, &mut rng).as_secs_f64() * 1000.0)
        .collect();
    v.sort_by(f64::total_cmp);
    qs.iter().map(|q| v[(q * n as f64) as usize]).collect()
}

#[test]
fn a_heavy_tailed_latency_is_drawn_as_written() {
    let parse = |text: &str| MockProfile::from_toml(text, "m.toml");
    // A Pareto tail beyond the body's p95: p50 and p95 stay the body's, p99 and p99.9
    // follow P(L > x) = 0.05·(p95/x)^α, far beyond the log-normal's.
    let tail =
        parse("[chat]\nlatency = { p50_ms = 40, p95_ms = 80, tail = { shape = 1.5 } }\n").unwrap();
    let plain = parse("[chat]\nlatency = { p50_ms = 40, p95_ms = 80 }\n").unwrap();
    let qs = [0.5, 0.95, 0.99, 0.999];
    let (t, l) = (
        quantiles(&tail, 200_000, &qs),
        quantiles(&plain, 200_000, &qs),
    );
    // Sampling error: the p99.9 of 200,000 draws has 200 beyond it (±3σ ≈ ±21% of them,
    // ±14% in x as x ∝ count^(−1/1.5)); the p99 2,000 (±7% of them, ±5% in x).
    let near = |x: f64, want: f64, tol: f64| (x / want - 1.0).abs() < tol;
    assert!(near(t[0], 40.0, 0.05) && near(t[1], 80.0, 0.05), "{t:?}");
    assert!(near(t[2], 80.0 * 5f64.powf(1.0 / 1.5), 0.05), "p99 {t:?}");
    assert!(
        near(t[3], 80.0 * 50f64.powf(1.0 / 1.5), 0.15),
        "p99.9 {t:?}"
    );
    assert!(t[3] > 5.0 * l[3], "tail {t:?} against log-normal {l:?}");
    // A mixture: 90% fast, 10% slow.
    let mix = parse(
        "[chat]\nlatency = { mixture = [{ weight = 0.9, p50_ms = 10, p95_ms = 12 }, \
         { weight = 0.1, p50_ms = 500, p95_ms = 600 }] }\n",
    )
    .unwrap();
    let m = quantiles(&mix, 20_000, &[0.5, 0.85, 0.95]);
    assert!(m[0] < 12.0 && m[1] < 13.0 && m[2] > 400.0, "{m:?}");
    // Bad shapes name the field and the fix.
    let e = parse("[chat]\nlatency = { p50_ms = 40, p95_ms = 80, tail = { shape = 0.9 } }\n")
        .unwrap_err();
    assert!(
        e.starts_with("m.toml: `chat.latency.tail.shape`: must be a number above 1"),
        "{e}"
    );
    let e = parse("[chat]\nlatency = { mixture = [{ weight = 0.5, p50_ms = 1, p95_ms = 2 }] }\n")
        .unwrap_err();
    assert!(
        e.contains("`chat.latency.mixture`: the weights must sum to 1"),
        "{e}"
    );
    let e =
        parse("[chat]\nlatency = { p50_ms = 0, p95_ms = 0, tail = { shape = 2 } }\n").unwrap_err();
    assert!(e.contains("needs 0 < p50_ms"), "{e}");
}

#[test]
fn a_fault_mix_is_checked_and_drawn_by_share() {
    let err = |text: &str| MockProfile::from_toml(text, "m.toml").unwrap_err();
    let e = err("[chat]\nfault_mix = { reset = 0.7, no_answer = 0.4 }\n");
    assert_eq!(
        e,
        "m.toml: `chat.fault_mix`: the shares must add up to at most 1, got 1.1"
    );
    let e = err("[chat]\nfault_mix = { flapping = 0.1 }\n");
    assert!(e.contains("depends on the call history"), "{e}");
    let e = err("[chat]\nfault = \"reset\"\nfault_mix = { no_answer = 0.1 }\n");
    assert!(e.contains("cannot be combined with `fault"), "{e}");
    let e = err("[chat]\nfault_mix = { exploding = 0.1 }\n");
    assert!(e.contains("`chat.fault_mix"), "{e}");
    let e = err("[models.m]\nhang_ms = -1\n");
    assert_eq!(e, "m.toml: `models.m.hang_ms`: milliseconds ≥ 0, got -1");
    let p = MockProfile::from_toml(
        "[chat]\nfault_mix = { reset = 0.1, stream_cut = 0.2 }\nhang_ms = 500\n",
        "m.toml",
    )
    .unwrap();
    // Faults in their declared order (Fault's order): reset on [0, 0.1), stream_cut on
    // [0.1, 0.3), none above (0.31: the float sum 0.1 + 0.2 is a hair over 0.3).
    let mix = &p.chat.fault_mix;
    assert_eq!(mixed_fault(mix, 0.05), Some(Fault::Reset));
    assert_eq!(mixed_fault(mix, 0.1), Some(Fault::StreamCut));
    assert_eq!(mixed_fault(mix, 0.29), Some(Fault::StreamCut));
    assert_eq!(mixed_fault(mix, 0.31), None);
    assert_eq!(mixed_fault(&std::collections::BTreeMap::new(), 0.0), None);
}

#[test]
fn calls_are_counted_per_model_and_the_names_kept_are_bounded() {
    let c = Counters::default();
    for i in 0..MAX_COUNTED_MODELS + 10 {
        let n = c.count_model(&format!("m{i}"));
        // Past the bound, the calls share one count.
        let want = i.saturating_sub(MAX_COUNTED_MODELS - 1).max(1) as u64;
        assert_eq!(n, want, "m{i}");
    }
    assert_eq!(
        c.count_model("m0"),
        2,
        "a model's calls are numbered from 1"
    );
    let models = c.models.lock().unwrap();
    assert_eq!(models.len(), MAX_COUNTED_MODELS + 1);
    assert_eq!(models[OTHER_MODELS], 10);
}

#[test]
fn recent_requests_are_bounded_in_count_and_bytes() {
    use crate::errors::Speaks;
    use crate::recent::{Recent, MAX_BODY_BYTES, MAX_KEPT};
    let recent = Recent::default();
    for i in 0..MAX_KEPT + 3 {
        recent.keep(
            Speaks::Gemini,
            "/v1beta/models/m:generateContent",
            format!("{{\"n\":{i}}}").as_bytes(),
        );
    }
    let big = vec![b' '; MAX_BODY_BYTES + 1];
    recent.keep(Speaks::Bedrock, "/model/m/converse", &big);
    let list = recent.list();
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), MAX_KEPT);
    // The oldest gave way: the first kept is the fifth sent (three more and the big one).
    assert_eq!(list[0]["body"]["n"], 4);
    assert_eq!(list[0]["dialect"], "gemini");
    let last = &list[MAX_KEPT - 1];
    assert_eq!(
        (
            last["dialect"].as_str(),
            last["body"].is_null(),
            last["truncated"].as_bool(),
            last["bytes"].as_u64()
        ),
        (
            Some("bedrock"),
            true,
            Some(true),
            Some(MAX_BODY_BYTES as u64 + 1)
        )
    );
}
