//! Prometheus metrics, rendered as text at `GET /metrics`.

use equiroute_core::features::Fnv64;
use equiroute_core::hash::KeyHasher;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::RwLock;

/// Counters by their key (`counter_hash`), the key already spread.
type CounterMap = HashMap<u64, Vec<Counter>, BuildHasherDefault<KeyHasher>>;

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

/// The key a counter is found by: FNV-1a over its name and labels. The parts are ours (names,
/// configured interface and provider ids, fixed outcomes), never a client's, so a fast hash
/// without flood resistance is enough; collisions share a list and are told apart by `is`.
fn counter_hash(name: &str, labels: &[(&'static str, &str)]) -> u64 {
    let mut h = Fnv64::new();
    h.write(name.as_bytes());
    for (k, v) in labels {
        h.write(&[0x1f]);
        h.write(k.as_bytes());
        h.write(&[0x1e]);
        h.write(v.as_bytes());
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

/// Upper bounds (USD) of the request-cost histogram buckets.
const COST_BUCKETS_USD: [f64; 10] = [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0];

/// Upper bounds (s) of the feedback-delay histogram buckets.
const DELAY_BUCKETS_S: [f64; 10] = [0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0];

/// The histograms kept per interface (the interface is the only label: it comes from the
/// configuration, never from a client).
/// Its discriminant indexes a shard's maps, in [`PerInterface::ALL`]'s order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PerInterface {
    /// End-to-end request latency (ms).
    RequestLatency,
    /// A streamed attempt's time to its first byte (ms).
    FirstByte,
    /// What a finished request cost, every attempt included (USD).
    RequestCost,
    /// From the answer to its accepted quality score (s).
    FeedbackDelay,
}

impl PerInterface {
    const ALL: [PerInterface; 4] = [
        PerInterface::RequestLatency,
        PerInterface::FirstByte,
        PerInterface::RequestCost,
        PerInterface::FeedbackDelay,
    ];

    fn name(self) -> &'static str {
        match self {
            PerInterface::RequestLatency => "equiroute_request_latency_ms",
            PerInterface::FirstByte => "equiroute_first_byte_ms",
            PerInterface::RequestCost => "equiroute_request_cost_usd",
            PerInterface::FeedbackDelay => "equiroute_feedback_delay_seconds",
        }
    }

    fn bounds(self) -> &'static [f64] {
        match self {
            PerInterface::RequestLatency | PerInterface::FirstByte => &LATENCY_BUCKETS_MS,
            PerInterface::RequestCost => &COST_BUCKETS_USD,
            PerInterface::FeedbackDelay => &DELAY_BUCKETS_S,
        }
    }

    /// The sum is kept in whole units of `1/scale` (USD: micro-dollars, so that sub-cent
    /// costs add up).
    fn scale(self) -> f64 {
        match self {
            PerInterface::RequestCost => 1e6,
            _ => 1e3,
        }
    }
}

/// The most buckets a histogram has (the decision buckets and the one past every bound).
const MAX_BUCKETS: usize = DECISION_BUCKETS_US.len() + 1;

/// A histogram updated without a lock: one atomic count per bucket, the last one past every
/// bound (not cumulative: the exposition accumulates, and the total is the count), and the
/// sum in thousandths of the unit. The counts are inline, so that a shard's histograms sit
/// in the shard's own cache lines.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// `bounds.len() + 1` of these are used.
    buckets: [AtomicU64; MAX_BUCKETS],
    /// The sum, in units of `1/scale`.
    sum_milli: AtomicU64,
    scale: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram::scaled(bounds, 1e3)
    }

    fn scaled(bounds: &'static [f64], scale: f64) -> Histogram {
        debug_assert!(bounds.len() < MAX_BUCKETS);
        Histogram {
            bounds,
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_milli: AtomicU64::new(0),
            scale,
        }
    }

    /// Counts `value` in the first bucket whose upper bound is at or above it (past every
    /// bound: the last).
    fn observe(&self, value: f64) {
        let i = self.bounds.partition_point(|b| *b < value);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        // Saturating float-to-int: a negative or NaN value adds nothing.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let milli = (value * self.scale).round() as u64;
        self.sum_milli.fetch_add(milli, Ordering::Relaxed);
    }

    /// Adds this histogram's counts and sum into `into` (buckets, then the sum).
    fn add_to(&self, into: &mut [u64; MAX_BUCKETS + 1]) {
        for (t, b) in into.iter_mut().zip(&self.buckets) {
            *t += b.load(Ordering::Relaxed);
        }
        into[MAX_BUCKETS] += self.sum_milli.load(Ordering::Relaxed);
    }
}

/// `name_bucket{labels,le="…"}` lines (cumulative), then `+Inf`, `_sum` and `_count`, of
/// the counts `totals` (as [`Histogram::add_to`] sums them) over `bounds`. `labels` is empty
/// or `k="v",…` without braces.
fn render_histogram(
    s: &mut String,
    name: &str,
    labels: &str,
    bounds: &[f64],
    totals: &[u64; MAX_BUCKETS + 1],
    scale: f64,
) {
    let (le, set) = if labels.is_empty() {
        (String::new(), String::new())
    } else {
        (format!("{labels},"), format!("{{{labels}}}"))
    };
    let mut total = 0;
    let names = bounds.iter().map(ToString::to_string);
    for (b, n) in names.chain(["+Inf".to_owned()]).zip(totals) {
        total += n;
        let _ = writeln!(s, "{name}_bucket{{{le}le=\"{b}\"}} {total}");
    }
    #[allow(clippy::cast_precision_loss)]
    let sum = totals[MAX_BUCKETS] as f64 / scale;
    let _ = writeln!(s, "{name}_sum{set} {sum}");
    let _ = writeln!(s, "{name}_count{set} {total}");
}

/// Shards of the metrics: each thread counts into its own (the event loops get one each), so
/// that two loops never write the same cache line; `/metrics` adds them up.
const SHARDS: usize = 16;

static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD_SHARD: usize = NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS;
}

/// One thread's counters and histograms, on cache lines of its own.
#[derive(Debug)]
#[repr(align(128))]
struct Shard {
    /// Counters by a hash of their name and labels (collisions share a list).
    counters: RwLock<CounterMap>,
    decision: Histogram,
    router: Histogram,
    /// Per family (latency, first byte, cost, feedback delay), per interface.
    per_interface: [RwLock<BTreeMap<String, Histogram>>; PerInterface::ALL.len()],
}

impl Default for Shard {
    fn default() -> Self {
        Shard {
            counters: RwLock::default(),
            decision: Histogram::new(&DECISION_BUCKETS_US),
            router: Histogram::new(&DECISION_BUCKETS_US),
            per_interface: Default::default(),
        }
    }
}

/// Counters and histograms of the gateway. The request path takes no exclusive lock and
/// writes only its thread's shard: counters and histograms are atomics found under the
/// shard's read locks.
#[derive(Debug)]
pub struct Metrics {
    shards: Box<[Shard]>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
        }
    }
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
    /// This thread's shard.
    fn shard(&self) -> &Shard {
        &self.shards[THREAD_SHARD.with(|i| *i)]
    }

    /// Adds one to the counter `name{labels}`. The request path finds an existing counter
    /// under a read lock by a hash of its parts, without building its text.
    fn bump(&self, name: &'static str, labels: &[(&'static str, &str)]) {
        self.add(name, labels, 1);
    }

    /// Adds `n` to the counter `name{labels}`.
    fn add(&self, name: &'static str, labels: &[(&'static str, &str)], n: u64) {
        let hash = counter_hash(name, labels);
        let shard = self.shard();
        if let Ok(map) = shard.counters.read() {
            if let Some(c) = map
                .get(&hash)
                .and_then(|v| v.iter().find(|c| c.is(name, labels)))
            {
                c.count.fetch_add(n, Ordering::Relaxed);
                return;
            }
        }
        if let Ok(mut map) = shard.counters.write() {
            let list = map.entry(hash).or_default();
            match list.iter().find(|c| c.is(name, labels)) {
                Some(c) => {
                    c.count.fetch_add(n, Ordering::Relaxed);
                }
                None => list.push(Counter {
                    name,
                    labels: labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
                    count: AtomicU64::new(n),
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

    /// A request that found every provider shut out by breakers that failures opened, and
    /// probed one as a last resort.
    pub fn last_resort(&self, interface: &str) {
        self.bump("equiroute_last_resort_total", &[("interface", interface)]);
    }

    /// A hedge `started`, `won` (its answer was the request's) or `cancelled` (an attempt
    /// of a hedged pair dropped when the other answered).
    pub fn hedge(&self, interface: &str, event: &'static str) {
        self.bump(
            "equiroute_hedges_total",
            &[("interface", interface), ("event", event)],
        );
    }

    /// A stream that broke after it reached the client, continued on another provider
    /// (`mode`: `prefix` or `restart`).
    pub fn stream_continuation(&self, interface: &str, mode: &'static str) {
        self.bump(
            "equiroute_stream_continuations_total",
            &[("interface", interface), ("mode", mode)],
        );
    }

    pub fn breaker(&self, provider: &str, transition: &str) {
        self.bump(
            "equiroute_breaker_transitions_total",
            &[("provider", provider), ("to", transition)],
        );
    }

    /// A request's task class was not on its interface's `task_classes` list (the class
    /// itself is no label: it is the client's).
    pub fn task_class_unlisted(&self, interface: &str) {
        self.bump(
            "equiroute_task_class_unlisted_total",
            &[("interface", interface)],
        );
    }

    /// `n` latency slices of `interface` were evicted to stay under `max_slices`.
    pub fn slices_evicted(&self, interface: &str, n: u64) {
        self.add(
            "equiroute_slices_evicted_total",
            &[("interface", interface)],
            n,
        );
    }

    pub fn feedback(&self, outcome: &str) {
        self.bump("equiroute_feedback_total", &[("outcome", outcome)]);
    }

    /// Records the decision of one request (eligibility + ranking), in µs.
    pub fn decision_time(&self, micros: f64) {
        self.shard().decision.observe(micros);
    }

    /// Records the router's whole share of one request, in µs: featurizing, sizing, the
    /// decision, and the bookkeeping after each attempt and after the answer (policy and
    /// breaker updates, metrics, keeping the context for feedback) — everything but the
    /// upstream calls and the HTTP handling.
    pub fn router_time(&self, micros: f64) {
        self.shard().router.observe(micros);
    }

    /// Records one request's end-to-end latency on `interface`, in ms.
    pub fn request_latency(&self, interface: &str, ms: f64) {
        self.per_interface(PerInterface::RequestLatency, interface, ms);
    }

    /// Records a streamed attempt's time to its first byte on `interface`, in ms.
    pub fn first_byte(&self, interface: &str, ms: f64) {
        self.per_interface(PerInterface::FirstByte, interface, ms);
    }

    /// Records what a finished request on `interface` cost, every attempt included, in USD.
    pub fn request_cost(&self, interface: &str, usd: f64) {
        self.per_interface(PerInterface::RequestCost, interface, usd);
    }

    /// Records the time from an answer on `interface` to its accepted quality score, in s.
    pub fn feedback_delay(&self, interface: &str, seconds: f64) {
        self.per_interface(PerInterface::FeedbackDelay, interface, seconds);
    }

    fn per_interface(&self, family: PerInterface, interface: &str, value: f64) {
        let map = &self.shard().per_interface[family as usize];
        if let Ok(l) = map.read() {
            if let Some(h) = l.get(interface) {
                h.observe(value);
                return;
            }
        }
        if let Ok(mut l) = map.write() {
            l.entry(interface.to_owned())
                .or_insert_with(|| Histogram::scaled(family.bounds(), family.scale()))
                .observe(value);
        }
    }

    /// The Prometheus text exposition (every shard added up).
    #[must_use]
    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut counters: BTreeMap<String, u64> = BTreeMap::new();
        let mut decision = [0; MAX_BUCKETS + 1];
        let mut router = [0; MAX_BUCKETS + 1];
        let mut per_interface: [BTreeMap<String, [u64; MAX_BUCKETS + 1]>; PerInterface::ALL.len()] =
            Default::default();
        for shard in &*self.shards {
            if let Ok(map) = shard.counters.read() {
                for c in map.values().flatten() {
                    *counters.entry(c.key()).or_default() += c.count.load(Ordering::Relaxed);
                }
            }
            shard.decision.add_to(&mut decision);
            shard.router.add_to(&mut router);
            for (map, totals) in shard.per_interface.iter().zip(per_interface.iter_mut()) {
                if let Ok(l) = map.read() {
                    for (iface, h) in l.iter() {
                        h.add_to(totals.entry(iface.clone()).or_insert([0; MAX_BUCKETS + 1]));
                    }
                }
            }
        }
        for (k, v) in counters {
            let _ = writeln!(s, "{k} {v}");
        }
        for (name, totals) in [
            ("equiroute_decision_microseconds", &decision),
            ("equiroute_router_microseconds", &router),
        ] {
            let _ = writeln!(s, "# TYPE {name} histogram");
            render_histogram(&mut s, name, "", &DECISION_BUCKETS_US, totals, 1e3);
        }
        for (family, by_interface) in PerInterface::ALL.into_iter().zip(&per_interface) {
            let _ = writeln!(s, "# TYPE {} histogram", family.name());
            for (iface, totals) in by_interface {
                let labels = format!("interface=\"{}\"", label(iface));
                render_histogram(
                    &mut s,
                    family.name(),
                    &labels,
                    family.bounds(),
                    totals,
                    family.scale(),
                );
            }
        }
        // The trace export's counters are the process's (one export pipeline per process).
        for (name, value) in [
            (
                "equiroute_trace_spans_dropped_total",
                crate::telemetry::spans_dropped(),
            ),
            (
                "equiroute_trace_spans_exported_total",
                crate::telemetry::spans_exported(),
            ),
            (
                "equiroute_trace_export_failures_total",
                crate::telemetry::export_failures(),
            ),
        ] {
            let _ = writeln!(s, "# TYPE {name} counter\n{name} {value}");
        }
        s
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
            .filter(|l| {
                !l.starts_with('#') && !l.contains("_microseconds") && !l.contains("_trace_")
            })
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

    #[test]
    fn histograms_render_cumulative_buckets_sum_and_count() {
        let m = Metrics::default();
        for us in [0.5, 2.5, 2.5, 7.0, 20_000.0] {
            m.router_time(us);
        }
        m.request_latency("chat", 30.0);
        m.request_latency("chat", 9.0);
        let text = m.render();
        let line = |prefix: &str| {
            text.lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
                .rsplit(' ')
                .next()
                .unwrap_or_default()
                .to_owned()
        };
        assert_eq!(line(r#"equiroute_router_microseconds_bucket{le="1"}"#), "1");
        assert_eq!(line(r#"equiroute_router_microseconds_bucket{le="3"}"#), "3");
        assert_eq!(line(r#"equiroute_router_microseconds_bucket{le="8"}"#), "4");
        assert_eq!(
            line(r#"equiroute_router_microseconds_bucket{le="10000"}"#),
            "4"
        );
        assert_eq!(
            line(r#"equiroute_router_microseconds_bucket{le="+Inf"}"#),
            "5"
        );
        assert_eq!(line("equiroute_router_microseconds_sum"), "20012.5");
        assert_eq!(line("equiroute_router_microseconds_count"), "5");
        assert_eq!(line("equiroute_decision_microseconds_count"), "0");
        let chat = r#"equiroute_request_latency_ms_bucket{interface="chat","#;
        assert_eq!(line(&format!(r#"{chat}le="10"}}"#)), "1");
        assert_eq!(line(&format!(r#"{chat}le="50"}}"#)), "2");
        assert_eq!(
            line(r#"equiroute_request_latency_ms_sum{interface="chat"}"#),
            "39"
        );
    }

    #[test]
    fn counts_from_many_threads_add_up_across_shards() {
        let m = Metrics::default();
        std::thread::scope(|scope| {
            for t in 0..(SHARDS + 3) {
                let m = &m;
                scope.spawn(move || {
                    for _ in 0..100 {
                        m.request("chat", "ok");
                        m.router_time(4.0);
                        m.request_latency("chat", 30.0);
                    }
                    if t == 0 {
                        m.request("chat", "failed");
                    }
                });
            }
        });
        let text = m.render();
        let n = 100 * (SHARDS + 3);
        assert!(
            text.contains(&format!(
                "equiroute_requests_total{{interface=\"chat\",outcome=\"ok\"}} {n}\n"
            )),
            "{text}"
        );
        assert!(
            text.contains("equiroute_requests_total{interface=\"chat\",outcome=\"failed\"} 1\n")
        );
        assert!(text.contains(&format!(
            "equiroute_router_microseconds_bucket{{le=\"4\"}} {n}\n"
        )));
        assert!(text.contains(&format!("equiroute_router_microseconds_sum {}\n", 4 * n)));
        assert!(text.contains(&format!(
            "equiroute_request_latency_ms_count{{interface=\"chat\"}} {n}\n"
        )));
        assert_eq!(
            text.matches("equiroute_request_latency_ms_count").count(),
            1,
            "one series per interface, not per shard"
        );
    }
}
