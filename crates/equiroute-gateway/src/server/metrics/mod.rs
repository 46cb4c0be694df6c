//! Prometheus metrics, kept with `prometheus-client` and rendered at `GET /metrics` as
//! Prometheus text (version 0.0.4).
//!
//! Every label value is the gateway's own: a configured interface or provider id, or a word
//! from a fixed set (outcomes, statuses, events). The fixed words are `&'static str`s already;
//! ids are interned once for the life of the process ([`name`]), so that a request's label sets are `&'static str`s built without an
//! allocation; the interner is capped, so that even a bug passing a client's string could
//! not grow it without bound.
//!
//! The series whose label values are known at start-up (configured interfaces and providers
//! crossed with a closed set of words) are created at 0 then ([`Metrics::start_at_zero`]), so
//! that `rate()` and absence alerts work before the first event; the rest appear when first
//! recorded.

use crate::config::{GatewayConfig, InterfaceKind, StateConfig};
use equiroute_core::breaker::Transition;
use equiroute_core::executor::RequestStatus;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::HashSet;
use std::sync::{LazyLock, RwLock};

mod labels;
mod meters;
use labels::{
    AttemptLabels, BreakerLabels, EventLabels, FeedbackLabel, InterfaceLabel, KindLabel,
    LimitLabels, ModeLabels, OutcomeLabels, ProviderLabels, ReasonLabels, RefusalLabel,
    ShiftLabels, TokenLabels,
};
pub use meters::Meters;

/// A label value, interned.
type Name = &'static str;

/// The most distinct label values the process keeps; past it a new value is counted as
/// [`OVERFLOW`]. Configured ids and fixed words stay far below it.
const MAX_NAMES: usize = 4096;

/// The label value of everything past [`MAX_NAMES`].
const OVERFLOW: Name = "other";

static NAMES: LazyLock<RwLock<HashSet<Name>>> = LazyLock::new(RwLock::default);

/// `s` interned in the process's set of label values.
fn name(s: &str) -> Name {
    intern(&NAMES, MAX_NAMES, s)
}

/// `s` interned in `names`: found under a read lock, leaked once when new, [`OVERFLOW`] once
/// `names` holds `cap` values.
fn intern(names: &RwLock<HashSet<Name>>, cap: usize, s: &str) -> Name {
    if let Ok(set) = names.read() {
        if let Some(n) = set.get(s) {
            return n;
        }
    }
    let Ok(mut set) = names.write() else {
        return OVERFLOW;
    };
    if let Some(n) = set.get(s) {
        return n;
    }
    if set.len() >= cap {
        return OVERFLOW;
    }
    let n: Name = Box::leak(s.into());
    set.insert(n);
    n
}

/// The outcomes of `equiroute_requests_total` (`outcome_label`, and a request no
/// provider could take).
const REQUEST_OUTCOMES: [Name; 5] = [
    "ok",
    "failed",
    "deadline_exceeded",
    "client_error",
    "no_eligible_provider",
];

/// The statuses of `equiroute_attempts_total` (`AttemptStatus::as_str`).
const ATTEMPT_STATUSES: [Name; 5] = [
    "ok",
    "provider_error",
    "client_error",
    "timeout",
    "cancelled",
];

/// The `to` of `equiroute_breaker_transitions_total` (`transition_name`).
const BREAKER_TRANSITIONS: [Name; 3] = ["open", "half_open", "closed"];

/// The events of `equiroute_hedges_total`.
const HEDGE_EVENTS: [Name; 3] = ["started", "won", "cancelled"];

/// The reasons of `equiroute_hedge_reasons_total` (`HedgeReason::as_str`).
const HEDGE_REASONS: [Name; 4] = ["quantile", "deadline_risk", "priced", "latency"];

/// The outcomes of `equiroute_feedback_total`: the feedback route's, then the judge's.
const FEEDBACK_OUTCOMES: [Name; 8] = [
    "accepted",
    "duplicate",
    "expired",
    "unknown",
    "judge_accepted",
    "judge_failed",
    "judge_skipped",
    "judge_unmatched",
];

/// The outcomes of `equiroute_config_reloads_total`.
const RELOAD_OUTCOMES: [Name; 2] = ["applied", "refused"];

/// The outcomes of `equiroute_state_snapshots_total` (`saved`, then `WriteFailure::label`).
const SNAPSHOT_OUTCOMES: [Name; 4] = ["saved", "no_space", "io_error", "failed"];

/// The reasons of `equiroute_tls_handshake_failures_total`: no handshake within the header
/// timeout, bytes that are not TLS (plain HTTP to the HTTPS port), the client refused the
/// certificate (it does not trust its CA, or the name or dates are wrong), anything else.
pub const TLS_HANDSHAKE_FAILURES: [Name; 4] =
    ["timeout", "not_tls", "certificate_rejected", "other"];

/// The outcomes of `equiroute_tls_reloads_total`.
const TLS_RELOADS: [Name; 2] = ["ok", "refused"];

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

/// Upper bounds of the token-count histogram buckets (a short prompt to a long document).
const TOKEN_BUCKETS: [f64; 11] = [
    10.0,
    30.0,
    100.0,
    300.0,
    1000.0,
    3000.0,
    10_000.0,
    30_000.0,
    100_000.0,
    300_000.0,
    1_000_000.0,
];

/// Upper bounds (s) of the feedback-delay histogram buckets.
const DELAY_BUCKETS_S: [f64; 10] = [0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS_MS)
}

fn cost_histogram() -> Histogram {
    Histogram::new(COST_BUCKETS_USD)
}

fn token_histogram() -> Histogram {
    Histogram::new(TOKEN_BUCKETS)
}

fn delay_histogram() -> Histogram {
    Histogram::new(DELAY_BUCKETS_S)
}

/// A histogram family whose buckets its constructor sets.
type Histograms<S> = Family<S, Histogram, fn() -> Histogram>;

/// Counters and histograms of the gateway. Each recorder finds its series in its family
/// (a hash of the interned label set under the family's read lock) and updates it.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<OutcomeLabels, Counter>,
    attempts: Family<AttemptLabels, Counter>,
    fallbacks: Family<InterfaceLabel, Counter>,
    last_resort: Family<InterfaceLabel, Counter>,
    rejections_disputed: Family<ProviderLabels, Counter>,
    hedges: Family<EventLabels, Counter>,
    hedge_reasons: Family<ReasonLabels, Counter>,
    stream_continuations: Family<ModeLabels, Counter>,
    breaker: Family<BreakerLabels, Counter>,
    capacity_skips: Family<LimitLabels, Counter>,
    task_class_unlisted: Family<InterfaceLabel, Counter>,
    task_class_too_long: Family<InterfaceLabel, Counter>,
    slices_evicted: Family<InterfaceLabel, Counter>,
    quality_shifts: Family<ShiftLabels, Counter>,
    feedback: Family<FeedbackLabel, Counter>,
    snapshots: Family<FeedbackLabel, Counter>,
    log_events: Family<KindLabel, Counter>,
    log_suppressed: Family<KindLabel, Counter>,
    refusals: Family<RefusalLabel, Counter>,
    tls_handshake_failures: Family<RefusalLabel, Counter>,
    tls_reloads: Family<FeedbackLabel, Counter>,
    config_reloads: Family<FeedbackLabel, Counter>,
    config_version: Gauge,
    config_loaded: Gauge<f64, std::sync::atomic::AtomicU64>,
    decision: Histogram,
    router: Histogram,
    request_latency: Histograms<InterfaceLabel>,
    first_byte: Histograms<InterfaceLabel>,
    request_cost: Histograms<InterfaceLabel>,
    feedback_delay: Histograms<InterfaceLabel>,
    provider_latency: Histograms<ProviderLabels>,
    provider_cost: Histograms<ProviderLabels>,
    provider_tokens: Histograms<TokenLabels>,
}

/// Registers `metric` as `name` (a counter's name is written with its `_total`, which the
/// crate adds back).
fn register(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: impl prometheus_client::registry::Metric,
) {
    registry.register(name.strip_suffix("_total").unwrap_or(name), help, metric);
}

/// The trace export's counters, read at each scrape: they are the process's (one export
/// pipeline per process).
#[derive(Debug)]
struct TraceExport;

impl Collector for TraceExport {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, value) in [
            (
                "equiroute_trace_spans_dropped_total",
                "Spans dropped because the export queue was full",
                crate::telemetry::spans_dropped(),
            ),
            (
                "equiroute_trace_spans_exported_total",
                "Spans the collector accepted",
                crate::telemetry::spans_exported(),
            ),
            (
                "equiroute_trace_export_failures_total",
                "Span batches the collector refused or never answered",
                crate::telemetry::export_failures(),
            ),
        ] {
            let counter = ConstCounter::new(value);
            let family = name.strip_suffix("_total").unwrap_or(name);
            counter.encode(encoder.encode_descriptor(
                family,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let m = Metrics {
            registry: Registry::default(),
            requests: Family::default(),
            attempts: Family::default(),
            fallbacks: Family::default(),
            last_resort: Family::default(),
            rejections_disputed: Family::default(),
            hedges: Family::default(),
            hedge_reasons: Family::default(),
            stream_continuations: Family::default(),
            breaker: Family::default(),
            capacity_skips: Family::default(),
            task_class_unlisted: Family::default(),
            task_class_too_long: Family::default(),
            slices_evicted: Family::default(),
            quality_shifts: Family::default(),
            feedback: Family::default(),
            snapshots: Family::default(),
            log_events: Family::default(),
            log_suppressed: Family::default(),
            refusals: Family::default(),
            tls_handshake_failures: Family::default(),
            tls_reloads: Family::default(),
            config_reloads: Family::default(),
            config_version: Gauge::default(),
            config_loaded: Gauge::default(),
            decision: Histogram::new(DECISION_BUCKETS_US),
            router: Histogram::new(DECISION_BUCKETS_US),
            request_latency: Family::new_with_constructor(latency_histogram),
            first_byte: Family::new_with_constructor(latency_histogram),
            request_cost: Family::new_with_constructor(cost_histogram),
            feedback_delay: Family::new_with_constructor(delay_histogram),
            provider_latency: Family::new_with_constructor(latency_histogram),
            provider_cost: Family::new_with_constructor(cost_histogram),
            provider_tokens: Family::new_with_constructor(token_histogram),
        };
        m.registered()
    }
}

impl Metrics {
    /// These metrics with every family in the registry, in the exposition's order (the
    /// registry holds handles to the same series).
    fn registered(mut self) -> Metrics {
        let r = &mut self.registry;
        register(
            r,
            "equiroute_requests_total",
            "Finished requests by outcome",
            self.requests.clone(),
        );
        register(
            r,
            "equiroute_attempts_total",
            "Upstream attempts by provider and status",
            self.attempts.clone(),
        );
        register(
            r,
            "equiroute_fallbacks_total",
            "Attempts after the first, hedges aside",
            self.fallbacks.clone(),
        );
        register(
            r,
            "equiroute_last_resort_total",
            "Requests that probed a provider whose breaker was open, every one being open",
            self.last_resort.clone(),
        );
        register(
            r,
            "equiroute_hedges_total",
            "Hedges started, won and cancelled",
            self.hedges.clone(),
        );
        register(
            r,
            "equiroute_hedge_reasons_total",
            "Hedges started, by the part of the hedge rule that set their delay",
            self.hedge_reasons.clone(),
        );
        register(
            r,
            "equiroute_stream_continuations_total",
            "Broken streams continued on another provider",
            self.stream_continuations.clone(),
        );
        register(
            r,
            "equiroute_breaker_transitions_total",
            "Circuit breaker transitions by interface and provider",
            self.breaker.clone(),
        );
        register(
            r,
            "equiroute_capacity_skips_total",
            "Attempts not sent because the provider had no capacity left, by the limit used up",
            self.capacity_skips.clone(),
        );
        register(
            r,
            "equiroute_task_class_unlisted_total",
            "Requests whose task class is not on the interface's list",
            self.task_class_unlisted.clone(),
        );
        register(
            r,
            "equiroute_task_class_too_long_total",
            "Requests whose task class is longer than the gateway accepts (treated as none)",
            self.task_class_too_long.clone(),
        );
        register(
            r,
            "equiroute_slices_evicted_total",
            "Latency slices evicted to stay within max_slices and max_slice_bytes",
            self.slices_evicted.clone(),
        );
        register(
            r,
            "equiroute_feedback_total",
            "Quality feedback by outcome",
            self.feedback.clone(),
        );
        register(
            r,
            "equiroute_state_snapshots_total",
            "Snapshots of the learning state to its file: saved, or failed by cause (no_space, io_error, failed)",
            self.snapshots.clone(),
        );
        self.register_operations();
        self.register_histograms();
        self.register_by_provider();
        self.registry.register_collector(Box::new(TraceExport));
        self
    }

    /// The gateway's own housekeeping: repetitive log lines, and what its limits turned away.
    fn register_operations(&mut self) {
        let r = &mut self.registry;
        register(
            r,
            "equiroute_log_events_total",
            "Occurrences of repetitive log lines by kind, written or held back",
            self.log_events.clone(),
        );
        register(
            r,
            "equiroute_log_lines_suppressed_total",
            "Repetitive log lines held back by the rate limit, by kind",
            self.log_suppressed.clone(),
        );
        register(
            r,
            "equiroute_refusals_total",
            "Connections and requests turned away by a fair-share or memory limit, by reason (too_many_connections, overloaded, shed, too_many_buffered_bytes, buffered_bytes_full, too_many_requests_in_flight)",
            self.refusals.clone(),
        );
        register(
            r,
            "equiroute_tls_handshake_failures_total",
            "TLS handshakes of the HTTPS listener that failed, by reason (timeout, not_tls, certificate_rejected, other)",
            self.tls_handshake_failures.clone(),
        );
        register(
            r,
            "equiroute_tls_reloads_total",
            "Reloads of the HTTPS certificate and key, by outcome (ok; refused: the old pair keeps serving)",
            self.tls_reloads.clone(),
        );
        register(
            r,
            "equiroute_config_reloads_total",
            "Configuration reloads (SIGHUP, POST /v1/admin/reload): applied, or refused (invalid, or a setting that needs a restart)",
            self.config_reloads.clone(),
        );
        register(
            r,
            "equiroute_config_version",
            "The version of the configuration served: 1 at start, one more at each applied reload",
            self.config_version.clone(),
        );
        register(
            r,
            "equiroute_config_loaded_timestamp_seconds",
            "When the configuration served was loaded (Unix time, seconds)",
            self.config_loaded.clone(),
        );
    }

    /// The histograms without a provider label, in the exposition's order.
    fn register_histograms(&mut self) {
        let r = &mut self.registry;
        register(
            r,
            "equiroute_decision_microseconds",
            "Time spent on eligibility and ranking per request (µs)",
            self.decision.clone(),
        );
        register(
            r,
            "equiroute_router_microseconds",
            "The router's whole share of an answered request (µs)",
            self.router.clone(),
        );
        register(
            r,
            "equiroute_request_latency_ms",
            "End-to-end request latency (ms)",
            self.request_latency.clone(),
        );
        register(
            r,
            "equiroute_first_byte_ms",
            "A streamed attempt's time to its first byte (ms)",
            self.first_byte.clone(),
        );
        register(
            r,
            "equiroute_request_cost_usd",
            "What a finished request cost, every attempt included (USD)",
            self.request_cost.clone(),
        );
        register(
            r,
            "equiroute_feedback_delay_seconds",
            "Time from an answer to its accepted quality score (s)",
            self.feedback_delay.clone(),
        );
    }

    /// Registers the families labelled by interface and provider (the disputed rejections
    /// and the quality shifts, then the histograms).
    fn register_by_provider(&mut self) {
        let r = &mut self.registry;
        register(
            r,
            "equiroute_rejections_disputed_total",
            "4xx rejections by a provider of a request that a second provider then answered",
            self.rejections_disputed.clone(),
        );
        register(
            r,
            "equiroute_quality_shifts_total",
            "Shifts in a provider's quality scores detected by the live policy, by direction",
            self.quality_shifts.clone(),
        );
        register(
            r,
            "equiroute_provider_latency_ms",
            "End-to-end latency of the requests each provider answered (ms)",
            self.provider_latency.clone(),
        );
        register(
            r,
            "equiroute_provider_cost_usd",
            "What each attempt on a provider cost, failed ones included (USD)",
            self.provider_cost.clone(),
        );
        register(
            r,
            "equiroute_provider_tokens",
            "Tokens per attempt as each provider reported them, by token_type (input, output)",
            self.provider_tokens.clone(),
        );
    }

    /// Creates at 0 every series whose labels `cfg` fixes: by interface, by provider and
    /// by a closed set of words (outcomes, statuses, transitions; hedge events and reasons
    /// where the interface hedges; first bytes on chat interfaces; snapshot outcomes with a
    /// state file). Nothing a client
    /// sends is a label, so the series stay as many as the configuration makes them.
    pub fn start_at_zero(&self, cfg: &GatewayConfig) {
        for i in &cfg.interfaces {
            let interface = name(&i.name);
            let by_interface = InterfaceLabel { interface };
            for outcome in REQUEST_OUTCOMES {
                at_zero(&self.requests, &OutcomeLabels { interface, outcome });
            }
            for family in [
                &self.fallbacks,
                &self.last_resort,
                &self.task_class_unlisted,
                &self.task_class_too_long,
                &self.slices_evicted,
            ] {
                at_zero(family, &by_interface);
            }
            at_zero(&self.request_latency, &by_interface);
            at_zero(&self.request_cost, &by_interface);
            if i.kind == InterfaceKind::Chat {
                at_zero(&self.first_byte, &by_interface);
            }
            if i.hedge.enabled {
                for event in HEDGE_EVENTS {
                    at_zero(&self.hedges, &EventLabels { interface, event });
                }
                for reason in HEDGE_REASONS {
                    at_zero(&self.hedge_reasons, &ReasonLabels { interface, reason });
                }
            }
            for p in &i.providers {
                let provider = name(&p.candidate.id.0);
                self.provider_at_zero(interface, provider);
                for limit in crate::upstream::limits::declared(&p.caps) {
                    let labels = LimitLabels {
                        interface,
                        provider,
                        limit: limit.as_str(),
                    };
                    at_zero(&self.capacity_skips, &labels);
                }
            }
        }
        for outcome in FEEDBACK_OUTCOMES {
            at_zero(&self.feedback, &FeedbackLabel { outcome });
        }
        for outcome in RELOAD_OUTCOMES {
            at_zero(&self.config_reloads, &FeedbackLabel { outcome });
        }
        if matches!(cfg.state, Some(StateConfig::File(_))) {
            for outcome in SNAPSHOT_OUTCOMES {
                at_zero(&self.snapshots, &FeedbackLabel { outcome });
            }
        }
        if cfg.tls.is_some() {
            for reason in TLS_HANDSHAKE_FAILURES {
                at_zero(&self.tls_handshake_failures, &RefusalLabel { reason });
            }
            for outcome in TLS_RELOADS {
                at_zero(&self.tls_reloads, &FeedbackLabel { outcome });
            }
        }
    }

    /// [`Metrics::start_at_zero`] for one provider of one interface.
    fn provider_at_zero(&self, interface: Name, provider: Name) {
        for status in ATTEMPT_STATUSES {
            at_zero(
                &self.attempts,
                &AttemptLabels {
                    interface,
                    provider,
                    status,
                },
            );
        }
        for to in BREAKER_TRANSITIONS {
            at_zero(
                &self.breaker,
                &BreakerLabels {
                    interface,
                    provider,
                    to,
                },
            );
        }
        for direction in ["down", "up"] {
            at_zero(
                &self.quality_shifts,
                &ShiftLabels {
                    interface,
                    provider,
                    direction,
                },
            );
        }
        for token_type in ["input", "output"] {
            at_zero(
                &self.provider_tokens,
                &TokenLabels {
                    interface,
                    provider,
                    token_type,
                },
            );
        }
        let by_provider = ProviderLabels {
            interface,
            provider,
        };
        at_zero(&self.rejections_disputed, &by_provider);
        at_zero(&self.provider_latency, &by_provider);
        at_zero(&self.provider_cost, &by_provider);
    }

    pub fn request(&self, interface: &str, outcome: &'static str) {
        let labels = OutcomeLabels {
            interface: name(interface),
            outcome,
        };
        self.requests.get_or_create(&labels).inc();
    }

    pub fn attempt(&self, interface: &str, provider: &str, status: &'static str) {
        let labels = AttemptLabels {
            interface: name(interface),
            provider: name(provider),
            status,
        };
        self.attempts.get_or_create(&labels).inc();
    }

    /// A request that found every provider shut out by breakers that failures opened, and
    /// probed one as a last resort.
    pub fn last_resort(&self, interface: &str) {
        self.last_resort.get_or_create(&iface(interface)).inc();
    }

    /// `provider` rejected a request (a 4xx) that another provider of `interface` then
    /// answered: the rejection was the provider's, not the request's.
    pub fn rejection_disputed(&self, interface: &str, provider: &str) {
        self.rejections_disputed
            .get_or_create(&by_provider(interface, provider))
            .inc();
    }

    /// A hedge `started`, `won` (its answer was the request's) or `cancelled` (an attempt
    /// of a hedged pair dropped when the other answered).
    pub fn hedge(&self, interface: &str, event: &'static str) {
        let labels = EventLabels {
            interface: name(interface),
            event,
        };
        self.hedges.get_or_create(&labels).inc();
    }

    /// A hedge started, with the part of the rule that set its delay
    /// ([`equiroute_core::hedge::HedgeReason::as_str`]).
    pub fn hedge_reason(&self, interface: &str, reason: &'static str) {
        let labels = ReasonLabels {
            interface: name(interface),
            reason,
        };
        self.hedge_reasons.get_or_create(&labels).inc();
    }

    /// A stream that broke after it reached the client, continued on another provider
    /// (`mode`: `prefix` or `restart`).
    pub fn stream_continuation(&self, interface: &str, mode: &'static str) {
        let labels = ModeLabels {
            interface: name(interface),
            mode,
        };
        self.stream_continuations.get_or_create(&labels).inc();
    }

    /// `provider`'s breaker on `interface` moved `to` (`open`, `half_open`, `closed`).
    pub fn breaker(&self, interface: &str, provider: &str, transition: &'static str) {
        let labels = BreakerLabels {
            interface: name(interface),
            provider: name(provider),
            to: transition,
        };
        self.breaker.get_or_create(&labels).inc();
    }

    /// An attempt on `provider` was not sent: its `limit` was used up.
    pub fn capacity_skip(&self, interface: &str, provider: &str, limit: &'static str) {
        let labels = LimitLabels {
            interface: name(interface),
            provider: name(provider),
            limit,
        };
        self.capacity_skips.get_or_create(&labels).inc();
    }

    /// A request's task class was not on its interface's `task_classes` list (the class
    /// itself is no label: it is the client's).
    pub fn task_class_unlisted(&self, interface: &str) {
        self.task_class_unlisted
            .get_or_create(&iface(interface))
            .inc();
    }

    /// A request's task class was longer than [`super::MAX_TASK_CLASS_BYTES`] (the class
    /// itself is no label: it is the client's).
    pub fn task_class_too_long(&self, interface: &str) {
        self.task_class_too_long
            .get_or_create(&iface(interface))
            .inc();
    }

    /// The counters of the repetitive log lines of `kind`: every occurrence, and those held
    /// back. Taken once, so that counting one is an atomic add.
    #[must_use]
    pub fn log_counters(&self, kind: &'static str) -> (Counter, Counter) {
        let labels = KindLabel { kind };
        (
            self.log_events.get_or_create(&labels).clone(),
            self.log_suppressed.get_or_create(&labels).clone(),
        )
    }

    /// The counter of refusals for `reason` (a fixed word). Taken once, so that counting one
    /// is an atomic add.
    #[must_use]
    pub fn refusals(&self, reason: &'static str) -> Counter {
        self.refusals
            .get_or_create(&RefusalLabel { reason })
            .clone()
    }

    /// The counter of failed TLS handshakes for `reason` (one of [`TLS_HANDSHAKE_FAILURES`]).
    #[must_use]
    pub fn tls_handshake_failures(&self, reason: &'static str) -> Counter {
        self.tls_handshake_failures
            .get_or_create(&RefusalLabel { reason })
            .clone()
    }

    /// The counter of reloads of the HTTPS certificate and key: `ok` (swapped in) or
    /// `refused` (the old pair kept).
    #[must_use]
    pub fn tls_reloads(&self, ok: bool) -> Counter {
        let outcome = if ok { "ok" } else { "refused" };
        self.tls_reloads
            .get_or_create(&FeedbackLabel { outcome })
            .clone()
    }

    /// `n` latency slices of `interface` were evicted to stay within `max_slices` and
    /// `max_slice_bytes`.
    pub fn slices_evicted(&self, interface: &str, n: u64) {
        self.slices_evicted
            .get_or_create(&iface(interface))
            .inc_by(n);
    }

    /// The live policy detected a shift of `provider`'s quality scores on `interface`
    /// (`direction`: `down` or `up`).
    pub fn quality_shift(&self, interface: &str, provider: &str, direction: &'static str) {
        let labels = ShiftLabels {
            interface: name(interface),
            provider: name(provider),
            direction,
        };
        self.quality_shifts.get_or_create(&labels).inc();
    }

    pub fn feedback(&self, outcome: &'static str) {
        let labels = FeedbackLabel { outcome };
        self.feedback.get_or_create(&labels).inc();
    }

    /// Records a reload of the configuration: `applied` or `refused`.
    pub fn config_reload(&self, outcome: &'static str) {
        let labels = FeedbackLabel { outcome };
        self.config_reloads.get_or_create(&labels).inc();
    }

    /// Sets the version of the configuration served and when it was loaded (Unix ms).
    pub fn config_loaded(&self, version: u64, loaded_unix_ms: f64) {
        self.config_version
            .set(i64::try_from(version).unwrap_or(i64::MAX));
        self.config_loaded.set(loaded_unix_ms / 1000.0);
    }

    /// Records a snapshot of the learning state to its file: `saved`, or why it failed
    /// (`no_space`, `io_error`, `failed`: the store's `WriteFailure::label`).
    pub fn snapshot(&self, outcome: &'static str) {
        let labels = FeedbackLabel { outcome };
        self.snapshots.get_or_create(&labels).inc();
    }

    /// Records the decision of one request (eligibility + ranking), in µs.
    pub fn decision_time(&self, micros: f64) {
        self.decision.observe(micros);
    }

    /// Records the router's whole share of one request, in µs: featurizing, sizing, the
    /// decision, and the bookkeeping after each attempt and after the answer (policy and
    /// breaker updates, metrics, keeping the context for feedback) — everything but the
    /// upstream calls and the HTTP handling.
    pub fn router_time(&self, micros: f64) {
        self.router.observe(micros);
    }

    /// Records a streamed attempt's time to its first byte on `interface`, in ms.
    pub fn first_byte(&self, interface: &str, ms: f64) {
        self.first_byte.get_or_create(&iface(interface)).observe(ms);
    }

    /// Records the time from an answer on `interface` to its accepted quality score, in s.
    pub fn feedback_delay(&self, interface: &str, seconds: f64) {
        self.feedback_delay
            .get_or_create(&iface(interface))
            .observe(seconds);
    }

    /// The Prometheus text exposition (version 0.0.4).
    #[must_use]
    pub fn render(&self) -> String {
        let mut s = String::new();
        // Writing into a `String` cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut s, &self.registry);
        s
    }
}

/// Creates the series of `labels` in `family`, at 0 unless it exists already.
fn at_zero<S, M, C>(family: &Family<S, M, C>, labels: &S)
where
    S: Clone + std::hash::Hash + Eq,
    C: MetricConstructor<M>,
{
    drop(family.get_or_create(labels));
}

fn iface(interface: &str) -> InterfaceLabel {
    InterfaceLabel {
        interface: name(interface),
    }
}

fn by_provider(interface: &str, provider: &str) -> ProviderLabels {
    ProviderLabels {
        interface: name(interface),
        provider: name(provider),
    }
}

/// The metric label of a breaker transition.
#[must_use]
pub fn transition_name(t: Transition) -> &'static str {
    match t {
        Transition::Opened => "open",
        Transition::HalfOpened => "half_open",
        Transition::Closed => "closed",
    }
}

/// The request outcome's name in metrics and the audit log.
pub(super) fn outcome_label(status: RequestStatus) -> &'static str {
    match status {
        RequestStatus::Succeeded { .. } => "ok",
        RequestStatus::ClientError { .. } => "client_error",
        RequestStatus::DeadlineExceeded => "deadline_exceeded",
        RequestStatus::Exhausted => "failed",
    }
}

#[cfg(test)]
mod tests;
