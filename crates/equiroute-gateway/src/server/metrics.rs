//! Prometheus metrics, rendered as text at `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

/// Upper bounds (µs) of the decision-time and router-time histogram buckets (fine around the
/// 10 µs target, so that its p99 can be read off).
const DECISION_BUCKETS_US: [f64; 16] = [
    1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 30.0, 50.0, 100.0, 1000.0, 10000.0,
];

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
    router: Mutex<Histogram>,
    /// Per interface: end-to-end request latency (ms).
    latency: Mutex<BTreeMap<String, Histogram>>,
}

/// A label value escaped for the exposition format (borrowed when nothing needs escaping,
/// which is every label the gateway writes on the request path).
fn label(v: &str) -> std::borrow::Cow<'_, str> {
    if v.contains(['\\', '"']) {
        std::borrow::Cow::Owned(v.replace('\\', "\\\\").replace('"', "\\\""))
    } else {
        std::borrow::Cow::Borrowed(v)
    }
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

    /// Records the decision of one request (eligibility + ranking), in µs.
    pub fn decision_time(&self, micros: f64) {
        observe_micros(&self.decision, micros);
    }

    /// Records the router's whole share of one request, in µs: featurizing, sizing, the
    /// decision, and the bookkeeping after each attempt and after the answer (policy and
    /// breaker updates, metrics, keeping the context for feedback) — everything but the
    /// upstream calls and the HTTP handling.
    pub fn router_time(&self, micros: f64) {
        observe_micros(&self.router, micros);
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
        render_micros(&mut s, "equiroute_decision_microseconds", &self.decision);
        render_micros(&mut s, "equiroute_router_microseconds", &self.router);
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

fn observe_micros(h: &Mutex<Histogram>, micros: f64) {
    if let Ok(mut d) = h.lock() {
        if d.0.is_empty() {
            d.0 = vec![0; DECISION_BUCKETS_US.len()];
        }
        // Cumulative buckets: every bound at or above the value counts it.
        let first = DECISION_BUCKETS_US.partition_point(|b| *b < micros);
        for c in &mut d.0[first..] {
            *c += 1;
        }
        d.1 += 1;
        d.2 += micros;
    }
}

fn render_micros(s: &mut String, name: &str, h: &Mutex<Histogram>) {
    if let Ok(d) = h.lock() {
        let _ = writeln!(s, "# TYPE {name} histogram");
        for (i, b) in DECISION_BUCKETS_US.iter().enumerate() {
            let n = d.0.get(i).copied().unwrap_or(0);
            let _ = writeln!(s, "{name}_bucket{{le=\"{b}\"}} {n}");
        }
        let _ = writeln!(s, "{name}_bucket{{le=\"+Inf\"}} {}", d.1);
        let _ = writeln!(s, "{name}_sum {}", d.2);
        let _ = writeln!(s, "{name}_count {}", d.1);
    }
}
