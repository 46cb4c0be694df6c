//! The simulated world: providers with latency, failure, quality and cost models, a load
//! trace and query generation. The same models serve the laboratory and the gateway's
//! in-process `sim` provider kind.

pub use equiroute_core::latency;
pub mod quality;

use crate::scenario::{EventKind, Metric, ProviderSpec, ScenarioSpec};
use equiroute_core::{
    AttemptOutcome, AttemptStatus, Candidate, CandidateId, Millis, ProviderFailure, Usd,
};
use latency::{LatencyModel, LogNormal};
use rand::{Rng, RngCore, SeedableRng};
use std::collections::BTreeMap;

/// One generated query: a hidden cluster and the text the featurizer sees.
#[derive(Clone, Debug, PartialEq)]
pub struct Query {
    pub cluster: usize,
    pub text: String,
}

/// Load, fault and quality factors of one provider at one round.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Conditions {
    pub latency_factor: f64,
    pub failure_rate: f64,
    pub rate_limit: f64,
    pub retry_after_ms: Option<f64>,
    pub outage: bool,
    pub quality_factor: f64,
}

/// A simulated provider.
#[derive(Clone, Debug)]
pub struct SimProvider {
    pub spec: ProviderSpec,
    warm: LatencyModel,
    cold: Option<(f64, LogNormal)>,
    last_call_ms: Option<f64>,
    /// Tokens in the bucket and when they were counted.
    tokens: (f64, f64),
}

impl SimProvider {
    fn new(spec: &ProviderSpec) -> SimProvider {
        SimProvider {
            warm: spec.latency.model(),
            cold: spec
                .cold_start
                .map(|c| (c.idle_ms, LogNormal::from_p50_p95(c.p50_ms, c.p95_ms))),
            spec: spec.clone(),
            last_call_ms: None,
            tokens: (spec.token_bucket.map_or(0.0, |b| b.burst), 0.0),
        }
    }

    /// Tokens available at `now_ms` (the bucket refilled since it was last counted).
    fn tokens_at(&self, now_ms: f64) -> f64 {
        self.spec.token_bucket.map_or(f64::INFINITY, |b| {
            let (tokens, at) = self.tokens;
            (tokens + b.rate_per_s * (now_ms - at).max(0.0) / 1000.0).min(b.burst)
        })
    }

    /// The conditions at `round` (events, no load).
    #[must_use]
    pub fn conditions(&self, round: usize) -> Conditions {
        let mut c = Conditions {
            latency_factor: 1.0,
            failure_rate: self.spec.failure_rate,
            rate_limit: 0.0,
            retry_after_ms: None,
            outage: false,
            quality_factor: 1.0,
        };
        for e in &self.spec.events {
            if round < e.start_round {
                continue;
            }
            let active = round < e.end_round;
            match e.kind {
                EventKind::RateLimit {
                    rate,
                    retry_after_ms,
                } if active => {
                    c.rate_limit = c.rate_limit.max(rate);
                    c.retry_after_ms = retry_after_ms;
                }
                EventKind::ErrorBurst { rate } if active => {
                    c.failure_rate = c.failure_rate.max(rate);
                }
                EventKind::Outage {} if active => c.outage = true,
                EventKind::Spike { latency_factor } if active => c.latency_factor *= latency_factor,
                EventKind::QualityDrop {
                    factor,
                    ramp_rounds,
                } if active => {
                    // A step without a ramp; with one, `factor` at its last round.
                    let done = if ramp_rounds == 0 {
                        1.0
                    } else {
                        ((round + 1 - e.start_round) as f64 / ramp_rounds as f64).min(1.0)
                    };
                    c.quality_factor *= 1.0 - (1.0 - factor) * done;
                }
                EventKind::Degrade {
                    latency_factor,
                    failure_rate,
                    recover_round,
                } if recover_round.is_none_or(|r| round < r) => {
                    // Ramps over the event, then stays degraded until it recovers.
                    let span = (e.end_round - e.start_round) as f64;
                    let progress = (((round - e.start_round) as f64) / span).min(1.0);
                    c.latency_factor *= 1.0 + (latency_factor - 1.0) * progress;
                    c.failure_rate = c.failure_rate.max(failure_rate * progress);
                }
                _ => {}
            }
        }
        c
    }
}

/// The whole simulated world of a scenario.
#[derive(Clone, Debug)]
pub struct World {
    pub providers: Vec<SimProvider>,
    metric: Metric,
    clusters: usize,
    load: Vec<(usize, f64)>,
    /// Smoothed share of first choices per provider: how load spreads.
    shares: Vec<f64>,
    tokens: equiroute_core::TokenEstimate,
    /// Expected gold quality per provider and cluster (exact for accuracy and F1, Monte Carlo
    /// for nDCG).
    expected_quality: Vec<Vec<f64>>,
    vocab: Vec<Vec<&'static str>>,
}

const TOPICS: [&[&str]; 8] = [
    &[
        "rust", "compiler", "borrow", "cargo", "trait", "lifetime", "crate", "async",
    ],
    &[
        "weather", "forecast", "rain", "storm", "humidity", "celsius", "wind", "climate",
    ],
    &[
        "football", "league", "goal", "transfer", "coach", "season", "match", "striker",
    ],
    &[
        "tax",
        "deduction",
        "income",
        "filing",
        "refund",
        "audit",
        "invoice",
        "vat",
    ],
    &[
        "recipe", "flour", "oven", "sauce", "vegan", "bake", "spice", "dessert",
    ],
    &[
        "flight", "airport", "visa", "hotel", "luggage", "layover", "airline", "passport",
    ],
    &[
        "history",
        "empire",
        "treaty",
        "dynasty",
        "revolution",
        "medieval",
        "war",
        "king",
    ],
    &[
        "genome", "protein", "enzyme", "cell", "mutation", "vaccine", "virus", "gene",
    ],
];
const ASKS: [&str; 6] = [
    "what is",
    "latest news on",
    "how does",
    "explain",
    "compare",
    "best sources for",
];

impl World {
    /// The world of `spec`.
    #[must_use]
    pub fn new(spec: &ScenarioSpec) -> World {
        let providers: Vec<SimProvider> = spec.providers.iter().map(SimProvider::new).collect();
        let k = providers.len();
        let mut load: Vec<(usize, f64)> = spec
            .load
            .iter()
            .map(|p| (p.until_round, p.concurrency))
            .collect();
        if load.is_empty() {
            load.push((usize::MAX, 1.0));
        }
        // A fixed stream for the nDCG expectations, so every seed sees the same oracle.
        let mut mc = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
        let expected_quality = spec
            .providers
            .iter()
            .map(|p| {
                p.quality
                    .iter()
                    .map(|&q| quality::expected(spec.metric, q, &mut mc))
                    .collect()
            })
            .collect();
        World {
            providers,
            metric: spec.metric,
            clusters: spec.clusters,
            load,
            shares: vec![1.0 / k as f64; k],
            tokens: spec.tokens,
            expected_quality,
            vocab: (0..spec.clusters)
                .map(|c| TOPICS[c % TOPICS.len()].to_vec())
                .collect(),
        }
    }

    /// Candidates for the policies, in provider order.
    #[must_use]
    pub fn candidates(&self) -> Vec<Candidate> {
        self.providers
            .iter()
            .map(|p| {
                let mut c = Candidate::new(
                    &p.spec.id,
                    &p.spec.id,
                    p.spec.model.as_deref().unwrap_or(&p.spec.id),
                );
                c.id = CandidateId(p.spec.id.clone());
                c.tier = p.spec.tier;
                c.price = p.spec.price;
                c
            })
            .collect()
    }

    /// Requests in flight on average at `round`.
    #[must_use]
    pub fn concurrency(&self, round: usize) -> f64 {
        self.load
            .iter()
            .find(|(until, _)| round < *until)
            .or(self.load.last())
            .map_or(1.0, |(_, c)| *c)
    }

    /// Whether provider `i` exists yet at `round`.
    #[must_use]
    pub fn available(&self, i: usize, round: usize) -> bool {
        self.providers[i].spec.join_round <= round
    }

    /// A query of a random cluster with generated text.
    pub fn query(&self, rng: &mut dyn RngCore) -> Query {
        let cluster = rng.random_range(0..self.clusters);
        let words = &self.vocab[cluster];
        let ask = ASKS[rng.random_range(0..ASKS.len())];
        let a = words[rng.random_range(0..words.len())];
        let b = words[rng.random_range(0..words.len())];
        let year = 2020 + rng.random_range(0..7);
        Query {
            cluster,
            text: format!("{ask} {a} {b} in {year}"),
        }
    }

    /// Latency multiplier of provider `i` from queueing: `1/(1 − ρ)` with
    /// `ρ = concurrency × share / capacity`, capped at 10×.
    #[must_use]
    pub fn load_factor(&self, i: usize, round: usize) -> f64 {
        match self.providers[i].spec.capacity {
            None => 1.0,
            Some(cap) => {
                let rho = (self.concurrency(round) * self.shares[i] / cap).min(0.9);
                1.0 / (1.0 - rho)
            }
        }
    }

    /// Requests in flight on provider `i` (for `least-busy`).
    #[must_use]
    pub fn in_flight(&self, i: usize, round: usize) -> u32 {
        (self.concurrency(round) * self.shares[i]).round() as u32
    }

    /// Notes that provider `i` was the first choice of a request (load follows choices).
    pub fn note_choice(&mut self, i: usize) {
        const ALPHA: f64 = 0.02;
        for (j, s) in self.shares.iter_mut().enumerate() {
            *s = (1.0 - ALPHA) * *s + if j == i { ALPHA } else { 0.0 };
        }
    }

    /// Makes one attempt on provider `i` at virtual time `now_ms`, cut at `timeout`.
    pub fn attempt(
        &mut self,
        i: usize,
        round: usize,
        now_ms: f64,
        timeout: Option<Millis>,
        rng: &mut dyn RngCore,
    ) -> AttemptOutcome {
        let load = self.load_factor(i, round);
        let p = &mut self.providers[i];
        let cond = p.conditions(round);
        let price = p.spec.price.cost(self.tokens);
        let idle = p.last_call_ms.map_or(f64::INFINITY, |t| now_ms - t);
        p.last_call_ms = Some(now_ms);
        let fail = |latency: f64, f: ProviderFailure, billed: bool| {
            let mut o = AttemptOutcome::with_status(latency, AttemptStatus::ProviderError(f));
            o.cost = if billed { price } else { Usd(0.0) };
            o
        };
        if cond.outage {
            return fail(
                5.0 + 20.0 * rng.random::<f64>(),
                ProviderFailure::Connection,
                false,
            );
        }
        if let Some(bucket) = p.spec.token_bucket {
            let tokens = p.tokens_at(now_ms);
            if tokens < 1.0 {
                p.tokens = (tokens, now_ms);
                let mut o = fail(
                    20.0 + 40.0 * rng.random::<f64>(),
                    ProviderFailure::RateLimited,
                    false,
                );
                if bucket.retry_after {
                    // Counted from the refusal's arrival, as a client reads it.
                    let next_token = (1.0 - tokens) / bucket.rate_per_s * 1000.0;
                    o.retry_after = Some(Millis((next_token - o.latency.0).max(0.0)));
                }
                return o;
            }
            p.tokens = (tokens - 1.0, now_ms);
        }
        if cond.rate_limit > 0.0 && rng.random::<f64>() < cond.rate_limit {
            let mut o = fail(
                20.0 + 40.0 * rng.random::<f64>(),
                ProviderFailure::RateLimited,
                false,
            );
            o.retry_after = cond.retry_after_ms.map(Millis);
            return o;
        }
        let drawn = match p.cold {
            Some((idle_ms, cold)) if idle > idle_ms => cold.sample(rng),
            _ => p.warm.sample(rng),
        };
        let latency = drawn * cond.latency_factor * load;
        if rng.random::<f64>() < cond.failure_rate {
            // A 5xx usually comes back faster than an answer, and is billed.
            return fail(latency * 0.3, ProviderFailure::Server, true);
        }
        if let Some(t) = timeout {
            if latency > t.0 {
                let mut o = AttemptOutcome::with_status(t.0, AttemptStatus::Timeout);
                o.cost = price;
                return o;
            }
        }
        let mut o = AttemptOutcome::ok(latency);
        o.cost = price;
        if let Some(bucket) = p.spec.token_bucket.filter(|b| b.announce) {
            // What the headers say at the answer's end: with less than one token left then,
            // the time until the next one (calls made meanwhile are not known yet).
            let left = p.tokens_at(now_ms + latency);
            if left < 1.0 {
                o.retry_after = Some(Millis((1.0 - left) / bucket.rate_per_s * 1000.0));
            }
        }
        o
    }

    /// The gold quality of provider `i`'s answer to a query of `cluster` at `round`.
    pub fn gold_quality(
        &self,
        i: usize,
        round: usize,
        cluster: usize,
        rng: &mut dyn RngCore,
    ) -> f64 {
        let p = &self.providers[i];
        let q = p.spec.quality[cluster] * p.conditions(round).quality_factor;
        quality::draw(self.metric, q, rng)
    }

    /// The true expected value of sending the request to provider `i`: expected gold quality
    /// times the probability of an answer within the deadline. This is what `oracle` ranks by
    /// and what regret is measured in.
    #[must_use]
    pub fn true_value(
        &self,
        i: usize,
        round: usize,
        now_ms: f64,
        cluster: usize,
        deadline: Option<Millis>,
    ) -> f64 {
        let p = &self.providers[i];
        let cond = p.conditions(round);
        if cond.outage || p.tokens_at(now_ms) < 1.0 {
            return 0.0;
        }
        let answer = (1.0 - cond.rate_limit) * (1.0 - cond.failure_rate);
        let in_time = deadline.map_or(1.0, |d| {
            p.warm
                .scaled(cond.latency_factor * self.load_factor(i, round))
                .cdf(d.0)
        });
        self.expected_quality[i][cluster] * cond.quality_factor * answer * in_time
    }

    /// Mean gold quality per provider over clusters (for reports).
    #[must_use]
    pub fn mean_quality(&self) -> BTreeMap<String, f64> {
        self.providers
            .iter()
            .zip(&self.expected_quality)
            .map(|(p, q)| (p.spec.id.clone(), q.iter().sum::<f64>() / q.len() as f64))
            .collect()
    }
}
