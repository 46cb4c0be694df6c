#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use equiroute_core::{AttemptOutcome, Millis, Usd};

fn attempt(candidate: usize, status: AttemptStatus, latency: f64) -> AttemptRecord {
    AttemptRecord {
        candidate,
        started: Timestamp(0.0),
        outcome: AttemptOutcome {
            latency: Millis(latency),
            status,
            cost: Usd(0.25),
            time_to_first_byte: None,
            retry_after: None,
        },
        retry: None,
        hedge: false,
    }
}

fn keys() -> Vec<KeyRow> {
    vec![
        KeyRow {
            label: "team-a".into(),
            tenant: Some("acme".into()),
        },
        KeyRow {
            label: "team-b".into(),
            tenant: None,
        },
    ]
}

fn ids() -> Vec<String> {
    vec!["a".into(), "b".into()]
}

#[test]
fn the_histogram_reads_quantiles_within_a_bucket_of_the_truth() {
    // Bucket i (1 ≤ i ≤ 30) ends at 120000^(i/30) ms: a factor of 120000^(1/30) ≈ 1.477.
    assert_eq!(Latencies::bucket(0.5), 0);
    assert_eq!(Latencies::bucket(1.0), 0);
    assert_eq!(Latencies::bucket(120_000.0), LATENCY_BUCKETS - 2);
    assert_eq!(Latencies::bucket(500_000.0), LATENCY_BUCKETS - 1);
    assert_eq!(Latencies::bucket(f64::NAN), 0);
    let mut l = Latencies::default();
    assert_eq!(l.quantile(0.5), None, "no sample, no quantile");
    // 1..=1000 ms: p50 = 500, p95 = 950, p99 = 990.
    for ms in 1..=1000 {
        l.add(f64::from(ms));
    }
    let width = LATENCY_MAX_MS.powf(1.0 / 30.0);
    for (q, truth) in [(0.5, 500.0), (0.95, 950.0), (0.99, 990.0)] {
        let got = l.quantile(q).unwrap();
        assert!(
            got > truth / width && got < truth * width,
            "p{q}: {got} vs {truth}"
        );
    }
    let mut slow = Latencies::default();
    slow.add(200_000.0);
    assert_eq!(slow.quantile(0.99), Some(LATENCY_MAX_MS), "beyond 120 s");
}

#[test]
fn attempts_are_counted_by_error_class_per_provider_and_requests_per_key() {
    let mut bins = Bins::new(MINUTE_MS, MINUTES, 2, 2);
    let t = Timestamp(1_800_000_000_000.0);
    let failures = [
        AttemptStatus::ProviderError(ProviderFailure::RateLimited),
        AttemptStatus::ProviderError(ProviderFailure::Server),
        AttemptStatus::Timeout,
        AttemptStatus::ProviderError(ProviderFailure::Connection),
        AttemptStatus::ClientError,
        AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
    ];
    for (i, f) in failures.into_iter().enumerate() {
        let attempts = [attempt(0, f, 10.0), attempt(1, AttemptStatus::Ok, 100.0)];
        bins.count(&Finished {
            at: t,
            attempts: &attempts,
            status: RequestStatus::Succeeded { candidate: 1 },
            latency_ms: 120.0,
            key: Some(i % 2),
            content_filter: false,
        });
    }
    let attempts = [attempt(0, AttemptStatus::Cancelled, 5.0)];
    bins.count(&Finished {
        at: t,
        attempts: &attempts,
        status: RequestStatus::Exhausted,
        latency_ms: 5.0,
        key: None,
        content_filter: false,
    });
    // A request refused by `a`'s content filter: its rejection counts as that class, not 4xx.
    let attempts = [attempt(0, AttemptStatus::ClientError, 8.0)];
    bins.count(&Finished {
        at: t,
        attempts: &attempts,
        status: RequestStatus::ClientError { candidate: 0 },
        latency_ms: 8.0,
        key: None,
        content_filter: true,
    });
    bins.tokens(t, 1, 30, 7);
    bins.score(t, 1, 0.75);
    bins.score(t, 1, 0.25);
    let v = bins.view(t, 0.0, &ids(), &keys(), 60);
    let last = 59;
    let a = &v["providers"]["a"];
    for class in ERROR_CLASSES {
        assert_eq!(a["errors"][class.name()][last], 1, "{}", class.name());
    }
    assert_eq!(a["attempts"][last], 8);
    assert_eq!(a["answered"][last], 0);
    assert_eq!(a["p50"][last], Value::Null, "no answer, no latency");
    let b = &v["providers"]["b"];
    assert_eq!(b["answered"][last], 6);
    assert_eq!(b["quality"][last], 0.5);
    let p50 = b["p50"][last].as_f64().unwrap();
    assert!(p50 > 100.0 / 1.48 && p50 < 100.0 * 1.48, "{p50}");
    assert_eq!(b["total"]["tokens_in"], 30);
    assert_eq!(b["total"]["tokens_out"], 7);
    assert_eq!(b["total"]["cost_usd"], 1.5, "six attempts at $0.25");
    assert_eq!(v["requests"][last], 8);
    assert_eq!(
        v["failed"][last], 2,
        "the cancelled and the refused request"
    );
    assert_eq!(v["total"]["requests"], 8);
    assert_eq!(v["keys"][0]["key"], "team-a");
    assert_eq!(v["keys"][0]["tenant"], "acme");
    assert_eq!(v["keys"][0]["requests"], 3);
    assert_eq!(v["keys"][1]["requests"], 3);
    assert_eq!(v["keys"][1]["failed"], 0);
    assert_eq!(
        v["keys"][0]["cost_usd"], 1.5,
        "three requests of two $0.25 attempts"
    );
}

#[test]
fn the_time_before_start_is_no_data_and_an_idle_minute_after_it_is_zero() {
    let mut bins = Bins::new(MINUTE_MS, MINUTES, 2, 0);
    let now = Timestamp(1_800_000_000_000.0);
    let started = now.0 - 3.5 * 60_000.0;
    let attempts = [attempt(0, AttemptStatus::Ok, 10.0)];
    bins.count(&Finished {
        at: now,
        attempts: &attempts,
        status: RequestStatus::Succeeded { candidate: 0 },
        latency_ms: 10.0,
        key: None,
        content_filter: false,
    });
    let v = bins.view(now, started, &ids(), &[], 10);
    let requests = v["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 10);
    // The minute of the start-up and the three after it are known; the six before are not.
    let nulls = requests.iter().filter(|r| r.is_null()).count();
    assert_eq!(nulls, 5, "{requests:?}");
    assert_eq!(requests[8], 0);
    assert_eq!(requests[9], 1);
    assert_eq!(v["providers"]["a"]["attempts"][2], Value::Null);
}

#[test]
fn a_saved_minute_ring_is_restored_for_the_same_providers_only_and_keys_by_label() {
    let mut bins = Bins::new(MINUTE_MS, MINUTES, 2, 2);
    let t = Timestamp(1_800_000_000_000.0);
    for minute in 0..3 {
        let attempts = [attempt(1, AttemptStatus::Ok, 40.0)];
        bins.count(&Finished {
            at: Timestamp(t.0 + f64::from(minute) * 60_000.0),
            attempts: &attempts,
            status: RequestStatus::Succeeded { candidate: 1 },
            latency_ms: 40.0,
            key: Some(1),
            content_filter: false,
        });
    }
    let now = Timestamp(t.0 + 2.0 * 60_000.0);
    let saved = bins.save(now, &ids(), &keys());
    assert_eq!(saved.bins.len(), 3, "only live bins are saved");
    let text = serde_json::to_string(&saved).unwrap();
    let back: SavedInterface = serde_json::from_str(&text).unwrap();
    // The same providers, the keys in another order: counts follow the label.
    let mut keys_swapped = keys();
    keys_swapped.reverse();
    let mut fresh = Bins::new(MINUTE_MS, MINUTES, 2, 2);
    assert_eq!(fresh.restore(&back, &ids(), &keys_swapped), 3);
    let v = fresh.view(now, now.0, &ids(), &keys_swapped, 5);
    assert_eq!(
        v["providers"]["b"]["answered"],
        json!([null, null, 1, 1, 1])
    );
    assert_eq!(v["keys"][0]["key"], "team-b");
    assert_eq!(v["keys"][0]["requests"], 3);
    // Other providers: nothing taken.
    let mut other = Bins::new(MINUTE_MS, MINUTES, 2, 2);
    assert_eq!(other.restore(&back, &["a".into(), "c".into()], &keys()), 0);
    // A bin older than the ring's 24 hours falls out when the ring moves on.
    let day_later = Timestamp(now.0 + MINUTE_MS as f64 * MINUTES as f64);
    assert_eq!(fresh.save(day_later, &ids(), &keys_swapped).bins.len(), 0);
}
