//! What recording one request's metrics costs the request path. `gateway` is the gateway's
//! `server::metrics::Metrics` (on `prometheus-client` since the hand-written exposition was
//! replaced: label values interned once, label sets of `&'static str`; an interface's series
//! taken once, `Meters`, since issue 45); beside it the bare
//! crate with the same families, labels and buckets, as usually written (a label set of owned
//! `String`s built per lookup) and at its best (label values `&'static str` constants). One
//! request of a single successful attempt records two counters
//! (`equiroute_requests_total{interface,outcome}`,
//! `equiroute_attempts_total{interface,provider,status}`) and four histograms (decision and
//! router time; latency and cost by interface), on 2 interfaces × 3 providers. The numbers
//! and the hand-written exposition's (measured before it was replaced, commit 207addd) are
//! in docs/operations.md.
//! Not run by CI: `cargo bench -p equiroute-gateway --bench metrics --profile dev --config
//! 'profile.dev.package.equiroute-gateway.opt-level=2' -- --warm-up-time 1 --measurement-time 3`.

#![allow(clippy::unwrap_used)]

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use equiroute_gateway::server::metrics::{Meters, Metrics};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

const INTERFACES: [&str; 2] = ["chat", "search"];
const PROVIDERS: [&str; 3] = ["openai-mini", "anthropic-haiku", "gemini-flash"];
const DECISION_BUCKETS_US: [f64; 16] = [
    1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 30.0, 50.0, 100.0, 1000.0, 10000.0,
];
const LATENCY_BUCKETS_MS: [f64; 10] = [
    10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0,
];
const COST_BUCKETS_USD: [f64; 10] = [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0];

/// The `n`th request: which interface and provider, and its numbers.
fn request(n: usize) -> (&'static str, &'static str, f64, f64, f64, f64) {
    let x = n as f64;
    (
        INTERFACES[n % 2],
        PROVIDERS[n % 3],
        3.0 + (x * 0.37).sin().abs() * 10.0,
        8.0 + (x * 0.11).cos().abs() * 20.0,
        40.0 + (x * 0.07).sin().abs() * 900.0,
        0.0004 + (x * 0.13).cos().abs() * 0.01,
    )
}

/// A histogram family by interface, its buckets given by the constructor.
type PerInterface<V> = Family<[(&'static str, V); 1], Histogram, fn() -> Histogram>;

/// The same families in `prometheus-client`, label values of type `V`.
struct Crate<V: Clone + std::hash::Hash + Eq + Send + Sync + std::fmt::Debug + 'static> {
    requests: Family<[(&'static str, V); 2], Counter>,
    attempts: Family<[(&'static str, V); 3], Counter>,
    decision: Histogram,
    router: Histogram,
    latency: PerInterface<V>,
    cost: PerInterface<V>,
}

impl<V> Crate<V>
where
    V: Clone
        + std::hash::Hash
        + Eq
        + Send
        + Sync
        + std::fmt::Debug
        + prometheus_client::encoding::EncodeLabelValue
        + 'static,
{
    fn new() -> (Self, Registry) {
        let c = Crate {
            requests: Family::default(),
            attempts: Family::default(),
            decision: Histogram::new(DECISION_BUCKETS_US),
            router: Histogram::new(DECISION_BUCKETS_US),
            latency: Family::new_with_constructor(
                (|| Histogram::new(LATENCY_BUCKETS_MS)) as fn() -> Histogram,
            ),
            cost: Family::new_with_constructor(
                (|| Histogram::new(COST_BUCKETS_USD)) as fn() -> Histogram,
            ),
        };
        let mut registry = Registry::default();
        registry.register("equiroute_requests", "requests", c.requests.clone());
        registry.register("equiroute_attempts", "attempts", c.attempts.clone());
        registry.register(
            "equiroute_decision_microseconds",
            "decision",
            c.decision.clone(),
        );
        registry.register("equiroute_router_microseconds", "router", c.router.clone());
        registry.register("equiroute_request_latency_ms", "latency", c.latency.clone());
        registry.register("equiroute_request_cost_usd", "cost", c.cost.clone());
        (c, registry)
    }

    fn record(&self, v: &dyn Fn(&'static str) -> V, n: usize) {
        let (iface, provider, decision, router, latency, cost) = request(n);
        self.attempts
            .get_or_create(&[
                ("interface", v(iface)),
                ("provider", v(provider)),
                ("status", v("ok")),
            ])
            .inc();
        self.requests
            .get_or_create(&[("interface", v(iface)), ("outcome", v("ok"))])
            .inc();
        self.decision.observe(decision);
        self.latency
            .get_or_create(&[("interface", v(iface))])
            .observe(latency);
        self.cost
            .get_or_create(&[("interface", v(iface))])
            .observe(cost);
        self.router.observe(router);
    }
}

/// The gateway's recorders: an interface's series taken once ([`Meters`], as its runtime
/// holds them), the router's histograms.
fn ours(m: &Metrics, meters: &[Meters; 2], n: usize) {
    let (_, _, decision, router, latency, cost) = request(n);
    let meters = &meters[n % 2];
    meters.attempt(m, n % 3, "ok", cost);
    meters.request(m, "ok");
    m.decision_time(decision);
    meters.request_end(latency, cost);
    m.router_time(router);
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("metrics_per_request");
    let m = Metrics::default();
    let meters = INTERFACES.map(|i| m.meters(i, PROVIDERS));
    let mut n = 0;
    g.bench_function("gateway", |b| {
        b.iter(|| {
            n += 1;
            ours(black_box(&m), &meters, n);
        });
    });
    let (owned, registry) = Crate::<String>::new();
    let mut n = 0;
    g.bench_function("prometheus_client_string_labels", |b| {
        b.iter(|| {
            n += 1;
            owned.record(&|s| s.to_owned(), black_box(n));
        });
    });
    let (interned, registry2) = Crate::<&'static str>::new();
    let mut n = 0;
    g.bench_function("prometheus_client_static_labels", |b| {
        b.iter(|| {
            n += 1;
            interned.record(&|s| s, black_box(n));
        });
    });
    g.finish();
    // Both expose the same numbers: a check that the two sides did the same work.
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(text.contains("equiroute_requests_total{interface=\"chat\",outcome=\"ok\"}"));
    assert!(m
        .render()
        .contains("equiroute_requests_total{interface=\"chat\",outcome=\"ok\"}"));
    drop(registry2);
    let mut g = c.benchmark_group("metrics_render");
    g.bench_function("gateway", |b| b.iter(|| black_box(m.render().len())));
    g.bench_function("prometheus_client", |b| {
        b.iter(|| {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
            black_box(text.len())
        });
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
