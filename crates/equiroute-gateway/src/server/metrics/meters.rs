//! An interface's series that every request records, held by its runtime (see [`Meters`]).

use super::labels::{AttemptLabels, InterfaceLabel, OutcomeLabels, ProviderLabels, TokenLabels};
use super::{name, Metrics, Name, ATTEMPT_STATUSES, REQUEST_OUTCOMES};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

/// An interface's series that every request records, taken from their families once (when
/// its runtime is built), so that recording one is an atomic add, not an interning and a
/// family lookup under a lock per label set. The same series as [`Metrics`]' recorders of the
/// same labels write (`/metrics` shows one series).
#[derive(Debug)]
pub struct Meters {
    interface: Name,
    request_latency: Histogram,
    request_cost: Histogram,
    /// By [`REQUEST_OUTCOMES`].
    requests: [Counter; REQUEST_OUTCOMES.len()],
    fallbacks: Counter,
    /// Per candidate, in configuration order.
    providers: Vec<ProviderMeters>,
}

/// One provider's [`Meters`].
#[derive(Debug)]
struct ProviderMeters {
    provider: Name,
    latency: Histogram,
    cost: Histogram,
    /// Input, then output tokens.
    tokens: [Histogram; 2],
    /// By [`ATTEMPT_STATUSES`].
    attempts: [Counter; ATTEMPT_STATUSES.len()],
}

impl Metrics {
    /// The series of `interface`'s requests and of its `providers` (ids, in configuration
    /// order).
    #[must_use]
    pub fn meters<'p>(
        &self,
        interface: &str,
        providers: impl IntoIterator<Item = &'p str>,
    ) -> Meters {
        let interface = name(interface);
        let by_interface = InterfaceLabel { interface };
        let provider = |id: &str| {
            let provider = name(id);
            let labels = ProviderLabels {
                interface,
                provider,
            };
            let tokens = |token_type| {
                let labels = TokenLabels {
                    interface,
                    provider,
                    token_type,
                };
                self.provider_tokens.get_or_create(&labels).clone()
            };
            ProviderMeters {
                provider,
                latency: self.provider_latency.get_or_create(&labels).clone(),
                cost: self.provider_cost.get_or_create(&labels).clone(),
                tokens: [tokens("input"), tokens("output")],
                attempts: ATTEMPT_STATUSES.map(|status| {
                    let labels = AttemptLabels {
                        interface,
                        provider,
                        status,
                    };
                    self.attempts.get_or_create(&labels).clone()
                }),
            }
        };
        Meters {
            interface,
            request_latency: self.request_latency.get_or_create(&by_interface).clone(),
            request_cost: self.request_cost.get_or_create(&by_interface).clone(),
            requests: REQUEST_OUTCOMES.map(|outcome| {
                let labels = OutcomeLabels { interface, outcome };
                self.requests.get_or_create(&labels).clone()
            }),
            fallbacks: self.fallbacks.get_or_create(&by_interface).clone(),
            providers: providers.into_iter().map(provider).collect(),
        }
    }
}

impl Meters {
    /// A request ended with `outcome` (one of [`REQUEST_OUTCOMES`]; another word is counted
    /// through `metrics`' family, so that nothing is lost).
    pub fn request(&self, metrics: &Metrics, outcome: &'static str) {
        match REQUEST_OUTCOMES.iter().position(|&o| o == outcome) {
            Some(at) => {
                self.requests[at].inc();
            }
            None => metrics.request(self.interface, outcome),
        }
    }

    /// A request's end-to-end latency in ms and its cost in USD (every attempt).
    pub fn request_end(&self, latency_ms: f64, cost_usd: f64) {
        self.request_latency.observe(latency_ms);
        self.request_cost.observe(cost_usd);
    }

    pub fn fallback(&self) {
        self.fallbacks.inc();
    }

    /// The end-to-end latency in ms of a request candidate `index` answered.
    pub fn provider_latency(&self, index: usize, ms: f64) {
        if let Some(p) = self.providers.get(index) {
            p.latency.observe(ms);
        }
    }

    /// One attempt on candidate `index`: its status (one of [`ATTEMPT_STATUSES`]; another
    /// word is counted through `metrics`' family) and its cost in USD.
    pub fn attempt(&self, metrics: &Metrics, index: usize, status: &'static str, cost_usd: f64) {
        let Some(p) = self.providers.get(index) else {
            return;
        };
        match ATTEMPT_STATUSES.iter().position(|&s| s == status) {
            Some(at) => {
                p.attempts[at].inc();
            }
            None => metrics.attempt(self.interface, p.provider, status),
        }
        p.cost.observe(cost_usd);
    }

    /// The tokens one attempt on candidate `index` used, as the provider reported them.
    pub fn provider_tokens(&self, index: usize, input: u32, output: u32) {
        if let Some(p) = self.providers.get(index) {
            p.tokens[0].observe(f64::from(input));
            p.tokens[1].observe(f64::from(output));
        }
    }
}
