//! Prometheus metrics, rendered as text at `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

/// Upper bounds (µs) of the decision-time histogram buckets.
const DECISION_BUCKETS_US: [f64; 8] = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1000.0];

/// Upper bounds (ms) of the request-latency histogram buckets.
const LATENCY_BUCKETS_MS: [f64; 10] = [
    10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0,
];

/// Bucket counts, observation count and sum of one histogram.
type Histogram = (Vec<u64>, u64, f64);

/// Counters and histograms of the gateway.
#[derive(Debug, Default)]
pub struct Metrics {
    counters: Mutex<BTreeMap<String, u64>>,
    decision: Mutex<Histogram>,
    /// Per interface: end-to-end request latency (ms).
    latency: Mutex<BTreeMap<String, Histogram>>,
}

fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"")
}

impl Metrics {
    fn add(&self, key: String) {
        if let Ok(mut c) = self.counters.lock() {
            *c.entry(key).or_default() += 1;
        }
    }

    pub fn request(&self, interface: &str, outcome: &str) {
        self.add(format!(
            "equiroute_requests_total{{interface=\"{}\",outcome=\"{}\"}}",
            label(interface),
            label(outcome)
        ));
    }

    pub fn attempt(&self, interface: &str, provider: &str, status: &str) {
        self.add(format!(
            "equiroute_attempts_total{{interface=\"{}\",provider=\"{}\",status=\"{}\"}}",
            label(interface),
            label(provider),
            label(status)
        ));
    }

    pub fn fallback(&self, interface: &str) {
        self.add(format!(
            "equiroute_fallbacks_total{{interface=\"{}\"}}",
            label(interface)
        ));
    }

    pub fn breaker(&self, provider: &str, transition: &str) {
        self.add(format!(
            "equiroute_breaker_transitions_total{{provider=\"{}\",to=\"{}\"}}",
            label(provider),
            label(transition)
        ));
    }

    pub fn feedback(&self, outcome: &str) {
        self.add(format!(
            "equiroute_feedback_total{{outcome=\"{}\"}}",
            label(outcome)
        ));
    }

    /// Records the router's share of one request (eligibility + ranking), in µs.
    pub fn decision_time(&self, micros: f64) {
        if let Ok(mut d) = self.decision.lock() {
            if d.0.is_empty() {
                d.0 = vec![0; DECISION_BUCKETS_US.len()];
            }
            for (i, b) in DECISION_BUCKETS_US.iter().enumerate() {
                if micros <= *b {
                    d.0[i] += 1;
                }
            }
            d.1 += 1;
            d.2 += micros;
        }
    }

    /// Records one request's end-to-end latency on `interface`, in ms.
    pub fn request_latency(&self, interface: &str, ms: f64) {
        if let Ok(mut l) = self.latency.lock() {
            let h = l
                .entry(interface.to_owned())
                .or_insert_with(|| (vec![0; LATENCY_BUCKETS_MS.len()], 0, 0.0));
            for (i, b) in LATENCY_BUCKETS_MS.iter().enumerate() {
                if ms <= *b {
                    h.0[i] += 1;
                }
            }
            h.1 += 1;
            h.2 += ms;
        }
    }

    /// The Prometheus text exposition.
    #[must_use]
    pub fn render(&self) -> String {
        let mut s = String::new();
        if let Ok(c) = self.counters.lock() {
            for (k, v) in c.iter() {
                let _ = writeln!(s, "{k} {v}");
            }
        }
        if let Ok(d) = self.decision.lock() {
            let _ = writeln!(s, "# TYPE equiroute_decision_microseconds histogram");
            for (i, b) in DECISION_BUCKETS_US.iter().enumerate() {
                let n = d.0.get(i).copied().unwrap_or(0);
                let _ = writeln!(
                    s,
                    "equiroute_decision_microseconds_bucket{{le=\"{b}\"}} {n}"
                );
            }
            let _ = writeln!(
                s,
                "equiroute_decision_microseconds_bucket{{le=\"+Inf\"}} {}",
                d.1
            );
            let _ = writeln!(s, "equiroute_decision_microseconds_sum {}", d.2);
            let _ = writeln!(s, "equiroute_decision_microseconds_count {}", d.1);
        }
        if let Ok(l) = self.latency.lock() {
            let _ = writeln!(s, "# TYPE equiroute_request_latency_ms histogram");
            for (iface, (buckets, count, sum)) in l.iter() {
                let i = label(iface);
                for (k, b) in LATENCY_BUCKETS_MS.iter().enumerate() {
                    let _ = writeln!(
                        s,
                        "equiroute_request_latency_ms_bucket{{interface=\"{i}\",le=\"{b}\"}} {}",
                        buckets[k]
                    );
                }
                let _ = writeln!(
                    s,
                    "equiroute_request_latency_ms_bucket{{interface=\"{i}\",le=\"+Inf\"}} {count}"
                );
                let _ = writeln!(
                    s,
                    "equiroute_request_latency_ms_sum{{interface=\"{i}\"}} {sum}"
                );
                let _ = writeln!(
                    s,
                    "equiroute_request_latency_ms_count{{interface=\"{i}\"}} {count}"
                );
            }
        }
        s
    }
}
