//! Prometheus metrics, rendered as text at `GET /metrics`.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

/// One counter: its name, labels and count.
#[derive(Debug)]
struct Counter {
    name: &'static str,
    labels: Vec<(&'static str, String)>,
    count: AtomicU64,
}

impl Counter {
    fn is(&self, name: &str, labels: &[(&'static str, &str)]) -> bool {
        self.name == name
            && self.labels.len() == labels.len()
            && self
                .labels
                .iter()
                .zip(labels)
                .all(|((k, v), (k2, v2))| k == k2 && v == v2)
    }

    /// `name{k="v",…}` as the exposition writes it.
    fn key(&self) -> String {
        let mut s = String::from(self.name);
        if !self.labels.is_empty() {
            s.push('{');
            for (i, (k, v)) in self.labels.iter().enumerate() {
                if i > 0 {
                    s.push(',');
                }
                let _ = write!(s, "{k}=\"{}\"", label(v));
            }
            s.push('}');
        }
        s
    }
}

fn counter_hash(name: &str, labels: &[(&'static str, &str)]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    for (k, v) in labels {
        k.hash(&mut h);
        v.hash(&mut h);
    }
    h.finish()
}

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
    /// Counters by a hash of their name and labels (collisions share a list).
    counters: RwLock<HashMap<u64, Vec<Counter>>>,
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
    /// Adds one to the counter `name{labels}`. The request path finds an existing counter
    /// under a read lock by a hash of its parts, without building its text.
    fn bump(&self, name: &'static str, labels: &[(&'static str, &str)]) {
        let hash = counter_hash(name, labels);
        if let Ok(map) = self.counters.read() {
            if let Some(c) = map
                .get(&hash)
                .and_then(|v| v.iter().find(|c| c.is(name, labels)))
            {
                c.count.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        if let Ok(mut map) = self.counters.write() {
            let list = map.entry(hash).or_default();
            match list.iter().find(|c| c.is(name, labels)) {
                Some(c) => {
                    c.count.fetch_add(1, Ordering::Relaxed);
                }
                None => list.push(Counter {
                    name,
                    labels: labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
                    count: AtomicU64::new(1),
                }),
            }
        }
    }

    pub fn request(&self, interface: &str, outcome: &str) {
        self.bump(
            "equiroute_requests_total",
            &[("interface", interface), ("outcome", outcome)],
        );
    }

    pub fn attempt(&self, interface: &str, provider: &str, status: &str) {
        self.bump(
            "equiroute_attempts_total",
            &[
                ("interface", interface),
                ("provider", provider),
                ("status", status),
            ],
        );
    }

    pub fn fallback(&self, interface: &str) {
        self.bump("equiroute_fallbacks_total", &[("interface", interface)]);
    }

    pub fn breaker(&self, provider: &str, transition: &str) {
        self.bump(
            "equiroute_breaker_transitions_total",
            &[("provider", provider), ("to", transition)],
        );
    }

    pub fn feedback(&self, outcome: &str) {
        self.bump("equiroute_feedback_total", &[("outcome", outcome)]);
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
            if let Some(h) = l.get_mut(interface) {
                observe(h, &LATENCY_BUCKETS_MS, ms);
            } else {
                let mut h = Histogram::default();
                observe(&mut h, &LATENCY_BUCKETS_MS, ms);
                l.insert(interface.to_owned(), h);
            }
        }
    }

    /// The Prometheus text exposition.
    #[must_use]
    pub fn render(&self) -> String {
        let mut s = String::new();
        if let Ok(map) = self.counters.read() {
            let sorted: BTreeMap<String, u64> = map
                .values()
                .flatten()
                .map(|c| (c.key(), c.count.load(Ordering::Relaxed)))
                .collect();
            for (k, v) in sorted {
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
        observe(&mut d, &DECISION_BUCKETS_US, micros);
    }
}

/// Counts `value` in a cumulative histogram with upper `bounds` (every bound at or above the
/// value counts it).
fn observe(h: &mut Histogram, bounds: &[f64], value: f64) {
    if h.0.len() != bounds.len() {
        h.0 = vec![0; bounds.len()];
    }
    let first = bounds.partition_point(|b| *b < value);
    for c in &mut h.0[first..] {
        *c += 1;
    }
    h.1 += 1;
    h.2 += value;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_add_up_per_label_set_and_render_escaped_and_sorted() {
        let m = Metrics::default();
        m.attempt("chat", "b", "ok");
        m.attempt("chat", "a", "ok");
        m.attempt("chat", "a", "ok");
        m.feedback("say \"hi\"");
        let text = m.render();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.contains("_microseconds"))
            .collect();
        assert_eq!(
            lines,
            [
                r#"equiroute_attempts_total{interface="chat",provider="a",status="ok"} 2"#,
                r#"equiroute_attempts_total{interface="chat",provider="b",status="ok"} 1"#,
                r#"equiroute_feedback_total{outcome="say \"hi\""} 1"#,
            ]
        );
    }
}
