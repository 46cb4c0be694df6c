//! Scenarios: the TOML format, its validation, and the built-in library.
//!
//! A scenario describes a simulated world (providers with latency, failure, quality and cost
//! models; load phases; a judge; a deadline) and the policies to compare in it. Built-in
//! scenarios are TOML files in `crates/equiroute-lab/scenarios/`, compiled in; users pass their
//! own with `--scenario-file`. `docs/scenarios.md` documents every field.

use equiroute_core::latency::check_latency;
pub use equiroute_core::latency::{
    LatencyComponentSpec, LatencyShapeSpec, LatencySpec, ParetoTailSpec,
};
use equiroute_core::policies::{ExplorationFloorConfig, PolicyConfig};
use equiroute_core::{Price, ServiceTier, TokenEstimate};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use thiserror::Error;

/// The quality metric a scenario scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Metric {
    /// Bernoulli correctness with the cluster's mean as probability.
    Accuracy,
    /// A bounded score: Beta-distributed around the cluster's mean.
    F1,
    /// nDCG@10 of a ranked list against graded relevance, computed as trec_eval does.
    Ndcg,
}

/// A scenario as written in TOML.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioSpec {
    pub name: String,
    pub description: String,
    /// What reference figure it reproduces, if any.
    #[serde(default)]
    pub reproduces: Option<String>,
    pub rounds: usize,
    pub metric: Metric,
    /// Number of hidden query clusters; every provider's `quality` has one entry per cluster.
    pub clusters: usize,
    /// Request deadline (SLA) in ms; attempts past it are cancelled and censored.
    #[serde(default)]
    pub deadline_ms: Option<f64>,
    /// Per-request deadlines drawn from this mix instead of one `deadline_ms` (e.g. interactive
    /// and batch calls on the same interface).
    #[serde(default)]
    pub deadline_mix: Vec<DeadlineShare>,
    /// Latency budget `L_ref` given to latency-aware policies (defaults to the deadline or 1 s).
    #[serde(default)]
    pub l_ref_ms: Option<f64>,
    #[serde(default = "default_dim")]
    pub feature_dim: usize,
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
    /// Virtual time between requests at concurrency 1, in ms.
    #[serde(default = "default_interarrival")]
    pub interarrival_ms: f64,
    /// Expected tokens per call, for per-token prices.
    #[serde(default)]
    pub tokens: TokenEstimate,
    /// Policies compared by default: policy names or labels of `variants`.
    pub policies: Vec<String>,
    /// Named policy configurations, e.g. a priority list with a given order.
    #[serde(default)]
    pub variants: Vec<Variant>,
    #[serde(default)]
    pub judge: JudgeSpec,
    /// Load phases in order; the last one lasts until the end.
    #[serde(default)]
    pub load: Vec<LoadPhase>,
    pub providers: Vec<ProviderSpec>,
}

fn default_dim() -> usize {
    64
}
fn default_attempts() -> u32 {
    2
}
fn default_interarrival() -> f64 {
    250.0
}

/// One entry of a deadline mix.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadlineShare {
    pub ms: f64,
    pub weight: f64,
}

/// A named policy configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    pub label: String,
    pub policy: PolicyConfig,
    /// An exploration floor around the policy (0: none): every eligible provider keeps at
    /// least this probability of going first.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub min_propensity: f64,
    /// The variant's latency reference is its own (`lqm`'s `l_ref_ms`, `lqm-ts`'s
    /// `lqm.l_ref_ms`, `additive`'s `latency_scale_ms` set in its table, or a configuration
    /// already resolved by [`ScenarioSpec::policy`]); otherwise it gets the scenario's
    /// `L_ref`, as a plain policy name does. Read from the text by
    /// [`ScenarioSpec::from_toml`].
    #[serde(skip)]
    pub own_l_ref: bool,
}

#[allow(clippy::trivially_copy_pass_by_ref, clippy::float_cmp)] // serde passes a reference; 0 is "unset"
fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// Whether a variant's policy table (as written) sets its latency reference.
fn sets_l_ref(policy: &toml::Value) -> bool {
    policy.get("l_ref_ms").is_some()
        || policy
            .get("lqm")
            .is_some_and(|lqm| lqm.get("l_ref_ms").is_some())
        || policy.get("latency_scale_ms").is_some()
}

/// How quality reaches the router: `u_judge = clip(u_gold + bias + N(0, noise_sd))`, after
/// `delay_rounds` rounds. The gold value stays hidden and is what the scenario scores.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JudgeSpec {
    pub noise_sd: f64,
    pub bias: f64,
    pub delay_rounds: usize,
    /// From `drift_at_round` on, the judge adds `drift_bias` for providers in `drift_providers`.
    pub drift_at_round: Option<usize>,
    pub drift_bias: f64,
    pub drift_providers: Vec<String>,
}

impl Default for JudgeSpec {
    fn default() -> Self {
        JudgeSpec {
            noise_sd: 0.05,
            bias: 0.0,
            delay_rounds: 5,
            drift_at_round: None,
            drift_bias: 0.0,
            drift_providers: Vec::new(),
        }
    }
}

/// A load phase: requests arrive `concurrency` times faster than at concurrency 1 and that
/// many are in flight on average.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadPhase {
    pub until_round: usize,
    pub concurrency: f64,
}

/// A provider of the simulated world.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderSpec {
    pub id: String,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub tier: ServiceTier,
    #[serde(default)]
    pub price: Price,
    /// Mean quality per query cluster, in [0, 1].
    pub quality: Vec<f64>,
    pub latency: LatencyShapeSpec,
    /// A call after `idle_ms` without traffic draws from this slower distribution.
    #[serde(default)]
    pub cold_start: Option<ColdStartSpec>,
    /// Requests in flight it serves before queueing inflates latency (`None`: unlimited).
    #[serde(default)]
    pub capacity: Option<f64>,
    /// Probability of a 5xx on any call.
    #[serde(default)]
    pub failure_rate: f64,
    /// A token-bucket rate limit: calls beyond it get 429 (the more traffic a router sends,
    /// the more it is refused).
    #[serde(default)]
    pub token_bucket: Option<TokenBucketSpec>,
    /// The round it becomes available (a newcomer); 0 = from the start.
    #[serde(default)]
    pub join_round: usize,
    #[serde(default)]
    pub events: Vec<EventSpec>,
}

/// A token bucket: `rate_per_s` tokens a second, at most `burst` stored; a call takes one.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBucketSpec {
    pub rate_per_s: f64,
    pub burst: f64,
    /// Whether a refusal carries `Retry-After` (the time until the next token).
    #[serde(default = "yes")]
    pub retry_after: bool,
    /// Whether answers announce the capacity left, as OpenAI's and Anthropic's rate-limit
    /// headers do: an answer that leaves the bucket with less than one token when it ends
    /// carries the time until the next one (`retry_after` on the answer, which rests the
    /// provider until then, as the gateway does with the headers). Off by default: the
    /// bucket says nothing until it refuses a call.
    #[serde(default)]
    pub announce: bool,
}

fn yes() -> bool {
    true
}

/// A cold-start tail.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ColdStartSpec {
    pub idle_ms: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
}

/// A fault episode between `start_round` (inclusive) and `end_round` (exclusive).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventSpec {
    pub kind: EventKind,
    pub start_round: usize,
    pub end_round: usize,
}

/// What goes wrong during an event. Every kind is time-limited by the event's rounds, except
/// a `degrade` without `recover_round`, which stays after its ramp.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum EventKind {
    /// A share `rate` of calls get 429, with a `Retry-After` when given.
    RateLimit {
        rate: f64,
        #[serde(default)]
        retry_after_ms: Option<f64>,
    },
    /// A share `rate` of calls get a billed 5xx (an error burst).
    ErrorBurst { rate: f64 },
    /// Every call fails to connect. (A struct variant, so that stray fields are rejected.)
    Outage {},
    /// Latency and failure rate ramp linearly up to these values over the event, then stay
    /// until `recover_round` (exclusive), or to the end without it.
    Degrade {
        latency_factor: f64,
        failure_rate: f64,
        #[serde(default)]
        recover_round: Option<usize>,
    },
    /// Latency multiplied by `latency_factor`.
    Spike { latency_factor: f64 },
    /// Quality multiplied by `factor` (a silent regression); with `ramp_rounds`, the factor
    /// goes linearly from 1 to `factor` over the event's first `ramp_rounds` rounds (a gradual
    /// one).
    QualityDrop {
        factor: f64,
        #[serde(default)]
        ramp_rounds: usize,
    },
}

impl EventKind {
    /// The kind's name as scenario files write it (`type = "…"`).
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::RateLimit { .. } => "rate-limit",
            EventKind::ErrorBurst { .. } => "error-burst",
            EventKind::Outage {} => "outage",
            EventKind::Degrade { .. } => "degrade",
            EventKind::Spike { .. } => "spike",
            EventKind::QualityDrop { .. } => "quality-drop",
        }
    }

    /// The first round after the event, for an event whose `end_round` is `end_round`: that
    /// round, a `degrade`'s `recover_round`, or `None` for a `degrade` that never recovers.
    #[must_use]
    pub fn end_round(&self, end_round: usize) -> Option<usize> {
        match self {
            EventKind::Degrade { recover_round, .. } => *recover_round,
            _ => Some(end_round),
        }
    }

    /// Checks the kind's own fields against `end_round`; returns the field (under `kind`) and
    /// the fix.
    fn check(&self, start_round: usize, end_round: usize) -> Result<(), (&'static str, String)> {
        let share = |field: &'static str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err((field, format!("is {v}; it must be between 0 and 1")))
            }
        };
        match *self {
            EventKind::RateLimit {
                rate,
                retry_after_ms,
            } => {
                share("rate", rate)?;
                if retry_after_ms.is_some_and(|r| !(r.is_finite() && r >= 0.0)) {
                    return Err((
                        "retry_after_ms",
                        "must be a number of ms ≥ 0, or left out for no Retry-After".to_owned(),
                    ));
                }
                Ok(())
            }
            EventKind::ErrorBurst { rate } => share("rate", rate),
            EventKind::Outage {} => Ok(()),
            EventKind::Degrade {
                latency_factor,
                failure_rate,
                recover_round,
            } => {
                if !(latency_factor.is_finite() && latency_factor >= 1.0) {
                    return Err((
                        "latency_factor",
                        format!("is {latency_factor}; a degradation needs a factor ≥ 1 (use `spike` to speed up)"),
                    ));
                }
                share("failure_rate", failure_rate)?;
                if recover_round.is_some_and(|r| r < end_round) {
                    return Err((
                        "recover_round",
                        "must be at or after end_round (the end of the ramp)".to_owned(),
                    ));
                }
                Ok(())
            }
            EventKind::Spike { latency_factor } => {
                if latency_factor.is_finite() && latency_factor > 0.0 {
                    Ok(())
                } else {
                    Err((
                        "latency_factor",
                        format!(
                            "is {latency_factor}; it must be a positive number (below 1 speeds up)"
                        ),
                    ))
                }
            }
            EventKind::QualityDrop {
                factor,
                ramp_rounds,
            } => {
                share("factor", factor)?;
                if ramp_rounds > end_round - start_round {
                    return Err((
                        "ramp_rounds",
                        format!(
                            "is {ramp_rounds}; the ramp must fit in the event's {} rounds \
                             (0, the default, is a step)",
                            end_round - start_round
                        ),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// A scenario that cannot be used, with the field and the fix.
#[derive(Debug, Error, PartialEq)]
pub enum ScenarioError {
    /// Not TOML, or a field of the wrong type or name: its path and the line and column.
    #[error("{file}: `{field}`: {message}")]
    Parse {
        file: String,
        field: String,
        message: String,
    },
    #[error("{file}: `{field}`: {fix}")]
    Invalid {
        file: String,
        field: String,
        fix: String,
    },
    #[error("unknown scenario `{name}`: built-in scenarios are {valid}")]
    Unknown { name: String, valid: String },
}

impl ScenarioSpec {
    /// Parses and validates a scenario from TOML text; `file` names it in errors.
    ///
    /// # Errors
    /// TOML syntax, unknown fields, or values that make no sense, with the field named.
    pub fn from_toml(text: &str, file: &str) -> Result<ScenarioSpec, ScenarioError> {
        let spec: ScenarioSpec =
            crate::toml_text::parse(text).map_err(|p| ScenarioError::Parse {
                file: file.to_owned(),
                field: p.field,
                message: p.fix,
            })?;
        let mut spec = spec;
        // Which variants set their own latency reference: only the text says.
        if let Ok(raw) = toml::from_str::<toml::Table>(text) {
            if let Some(toml::Value::Array(vs)) = raw.get("variants") {
                for (v, raw_v) in spec.variants.iter_mut().zip(vs) {
                    v.own_l_ref = raw_v.get("policy").is_some_and(sets_l_ref);
                }
            }
        }
        spec.validate(file)?;
        Ok(spec)
    }

    /// Checks every value and cross-reference.
    ///
    /// # Errors
    /// The first problem found, with the field path and the fix.
    pub fn validate(&self, file: &str) -> Result<(), ScenarioError> {
        let bad = |field: String, fix: &str| ScenarioError::Invalid {
            file: file.to_owned(),
            field,
            fix: fix.to_owned(),
        };
        if self.rounds == 0 {
            return Err(bad("rounds".into(), "must be at least 1"));
        }
        if self.clusters == 0 {
            return Err(bad("clusters".into(), "must be at least 1"));
        }
        if self.providers.is_empty() {
            return Err(bad(
                "providers".into(),
                "add at least one [[providers]] entry",
            ));
        }
        if let Some(d) = self.deadline_ms {
            if !(d.is_finite() && d > 0.0) {
                return Err(bad("deadline_ms".into(), "must be a positive number of ms"));
            }
        }
        for (n, d) in self.deadline_mix.iter().enumerate() {
            if !(d.ms.is_finite() && d.ms > 0.0 && d.weight.is_finite() && d.weight > 0.0) {
                return Err(bad(
                    format!("deadline_mix[{n}]"),
                    "ms and weight must be positive numbers",
                ));
            }
        }
        if !self.deadline_mix.is_empty() && self.deadline_ms.is_some() {
            return Err(bad(
                "deadline_mix".into(),
                "set either deadline_ms or deadline_mix, not both",
            ));
        }
        if self.l_ref_ms.is_some_and(|l| !(l.is_finite() && l > 0.0)) {
            return Err(bad("l_ref_ms".into(), "must be a positive number of ms"));
        }
        if !(self.interarrival_ms.is_finite() && self.interarrival_ms > 0.0) {
            return Err(bad(
                "interarrival_ms".into(),
                "must be a positive number of ms",
            ));
        }
        if self.max_attempts == 0 {
            return Err(bad("max_attempts".into(), "must be at least 1"));
        }
        if !(0.0..=1.0).contains(&self.judge.noise_sd) {
            return Err(bad("judge.noise_sd".into(), "must be between 0 and 1"));
        }
        let mut ids = BTreeSet::new();
        for (n, p) in self.providers.iter().enumerate() {
            if !ids.insert(p.id.as_str()) {
                return Err(bad(
                    format!("providers[{n}] ({}).id", p.id),
                    "provider ids must be unique",
                ));
            }
            self.validate_provider(n, p)
                .map_err(|(field, fix)| bad(field, &fix))?;
        }
        for (n, phase) in self.load.iter().enumerate() {
            if !(phase.concurrency.is_finite() && phase.concurrency > 0.0) {
                return Err(bad(
                    format!("load[{n}].concurrency"),
                    "must be a positive number",
                ));
            }
        }
        for name in &self.judge.drift_providers {
            if !ids.contains(name.as_str()) {
                return Err(bad(
                    "judge.drift_providers".into(),
                    "names a provider that is not configured",
                ));
            }
        }
        self.validate_policies()
            .map_err(|(field, fix)| bad(field, &fix))
    }

    /// Checks the policy list and the variants; returns the field path and the fix.
    fn validate_policies(&self) -> Result<(), (String, String)> {
        let labels: BTreeSet<&str> = self.variants.iter().map(|v| v.label.as_str()).collect();
        for p in &self.policies {
            if !labels.contains(p.as_str()) && PolicyConfig::from_name(p).is_err() {
                return Err((
                    "policies".into(),
                    format!("`{p}` is neither a policy name (see `equiroute policies`) nor the label of a [[variants]] entry"),
                ));
            }
        }
        for p in &self.policies {
            if let Some(fix) = self.assumption(p) {
                return Err(("policies".into(), fix));
            }
        }
        for v in &self.variants {
            let candidates: Vec<_> = self
                .providers
                .iter()
                .map(|p| equiroute_core::Candidate::new(&p.id, &p.id, "m"))
                .collect();
            v.policy
                .build(&candidates, self.feature_dim)
                .map_err(|e| (format!("variants ({}).policy", v.label), e.to_string()))?;
            ExplorationFloorConfig::new(v.min_propensity)
                .validate()
                .map_err(|e| {
                    (
                        format!("variants ({}).min_propensity", v.label),
                        e.to_string(),
                    )
                })?;
        }
        Ok(())
    }

    /// Checks one provider; returns the field path and the fix.
    fn validate_provider(&self, n: usize, p: &ProviderSpec) -> Result<(), (String, String)> {
        let at = |f: &str| format!("providers[{n}] ({}).{f}", p.id);
        if p.quality.len() != self.clusters {
            return Err((
                at("quality"),
                "needs exactly one value per cluster (see `clusters`)".to_owned(),
            ));
        }
        if p.quality.iter().any(|q| !(0.0..=1.0).contains(q)) {
            return Err((at("quality"), "values must be between 0 and 1".to_owned()));
        }
        p.latency
            .check()
            .map_err(|(sub, fix)| (at(&format!("latency{sub}")), fix))?;
        p.price
            .validate()
            .map_err(|e| (at("price"), e.to_string()))?;
        if let Some(c) = &p.cold_start {
            check_latency(&LatencySpec {
                p50_ms: c.p50_ms,
                p95_ms: c.p95_ms,
            })
            .map_err(|fix| (at("cold_start"), fix.to_owned()))?;
        }
        if p.capacity.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
            return Err((
                at("capacity"),
                "must be a positive number of requests in flight".to_owned(),
            ));
        }
        if let Some(b) = p.token_bucket {
            if !(b.rate_per_s.is_finite() && b.rate_per_s > 0.0 && b.burst >= 1.0) {
                return Err((
                    at("token_bucket"),
                    "needs rate_per_s > 0 and burst ≥ 1".to_owned(),
                ));
            }
        }
        if !(0.0..=1.0).contains(&p.failure_rate) {
            return Err((at("failure_rate"), "must be between 0 and 1".to_owned()));
        }
        if p.join_round >= self.rounds {
            return Err((at("join_round"), "must be before the last round".to_owned()));
        }
        for (k, e) in p.events.iter().enumerate() {
            let field = at(&format!("events[{k}]"));
            if e.end_round <= e.start_round {
                return Err((field, "end_round must be after start_round".to_owned()));
            }
            e.kind
                .check(e.start_round, e.end_round)
                .map_err(|(f, fix)| (format!("{field}.kind.{f}"), fix))?;
        }
        Ok(())
    }

    /// What the policy `label` would silently assume in this world, as an error message with
    /// the fix: `static` without a `candidate` among several providers (it would take the
    /// first), or `cheapest` where every provider costs the same per call (it would rank by
    /// file order). `None` when the policy is fully specified or `label` is unknown.
    #[must_use]
    pub fn assumption(&self, label: &str) -> Option<String> {
        match self.policy(label).ok()? {
            PolicyConfig::Static(c) if c.candidate.is_none() && self.providers.len() > 1 => {
                let first = self.providers.first().map_or("", |p| p.id.as_str());
                Some(format!(
                    "`{label}` is `static` without a `candidate`, so it would always pick the first provider (`{first}`): name the provider with a variant, [[variants]] label = \"{label}\", policy = {{ name = \"static\", candidate = \"{first}\" }}"
                ))
            }
            PolicyConfig::Cheapest(_) if self.providers.len() > 1 => {
                let costs: Vec<f64> = self
                    .providers
                    .iter()
                    .map(|p| p.price.cost(self.tokens).0)
                    .collect();
                let same = costs.iter().all(|c| (c - costs[0]).abs() < 1e-15);
                same.then(|| format!(
                    "`{label}` ranks by price, but every provider costs the same per call (${} with the scenario's `tokens`), so it would rank by file order: give the providers a `price` (per-token prices need `tokens`), or drop `{label}`",
                    costs[0]
                ))
            }
            _ => None,
        }
    }

    /// `L_ref`: explicit, else the deadline, else 1 s.
    #[must_use]
    pub fn l_ref(&self) -> f64 {
        self.l_ref_ms.or(self.deadline_ms).unwrap_or(1000.0)
    }

    /// The deadline of one request: the fixed one, or a draw from the mix.
    pub fn draw_deadline(&self, rng: &mut dyn rand::RngCore) -> Option<equiroute_core::Millis> {
        use rand::Rng;
        if self.deadline_mix.is_empty() {
            return self.deadline_ms.map(equiroute_core::Millis);
        }
        let total: f64 = self.deadline_mix.iter().map(|d| d.weight).sum();
        let mut u = rng.random::<f64>() * total;
        for d in &self.deadline_mix {
            if u < d.weight {
                return Some(equiroute_core::Millis(d.ms));
            }
            u -= d.weight;
        }
        self.deadline_mix
            .last()
            .map(|d| equiroute_core::Millis(d.ms))
    }

    /// [`Self::policy`] with some parameters changed: each `(path, value)` sets the field at
    /// the dotted `path` of the configuration's JSON form (`risk.level_beta`,
    /// `lqm.head.gate`) to `value`, as the laboratory's examples take `FIELD=VALUE`
    /// arguments.
    ///
    /// # Errors
    /// An unknown label, a path that names no field (named), or a value the field cannot
    /// take.
    pub fn policy_with(
        &self,
        label: &str,
        sets: &[(String, serde_json::Value)],
    ) -> Result<PolicyConfig, String> {
        let cfg = self.policy(label).map_err(|e| e.to_string())?;
        let mut json = serde_json::to_value(&cfg).map_err(|e| e.to_string())?;
        for (path, value) in sets {
            let (parents, last) = path.rsplit_once('.').unwrap_or(("", path));
            let mut at = &mut json;
            for part in parents.split('.').filter(|p| !p.is_empty()) {
                if at.get(part).is_none() {
                    let there: Vec<String> = at
                        .as_object()
                        .map(|o| o.keys().map(|k| format!("`{k}`")).collect())
                        .unwrap_or_default();
                    return Err(format!(
                        "`{label}` has no field `{part}` in `{path}`: the fields there are {}; name a nested field by its whole path from the policy's configuration (`lqm.head.gate`)",
                        there.join(", ")
                    ));
                }
                at = &mut at[part];
            }
            // A field left out of the JSON form (at its default) is added; a misspelt one
            // is refused when the configuration is read back.
            let table = at
                .as_object_mut()
                .ok_or_else(|| format!("`{label}`: `{parents}` in `{path}` is not a table"))?;
            table.insert(last.to_owned(), value.clone());
        }
        serde_json::from_value(json).map_err(|e| format!("`{label}`: {e}"))
    }

    /// The exploration floor of a variant label (none for plain policy names).
    #[must_use]
    pub fn floor(&self, label: &str) -> ExplorationFloorConfig {
        ExplorationFloorConfig::new(
            self.variants
                .iter()
                .find(|v| v.label == label)
                .map_or(0.0, |v| v.min_propensity),
        )
    }

    /// The policy configuration behind a name or variant label, tuned to the scenario
    /// (latency-aware policies get the scenario's `L_ref`, unless a variant sets its own).
    ///
    /// # Errors
    /// Neither a variant label nor a policy name.
    pub fn policy(&self, label: &str) -> Result<PolicyConfig, equiroute_core::ConfigError> {
        let mut cfg = match self.variants.iter().find(|v| v.label == label) {
            Some(v) if v.own_l_ref => return Ok(v.policy.clone()),
            Some(v) => v.policy.clone(),
            None => PolicyConfig::from_name(label)?,
        };
        let l_ref = self.l_ref();
        match &mut cfg {
            PolicyConfig::Lqm(c) => c.l_ref_ms = l_ref,
            PolicyConfig::LqmTs(c) => c.lqm.l_ref_ms = l_ref,
            PolicyConfig::Additive(c) => c.latency_scale_ms = l_ref,
            _ => {}
        }
        Ok(cfg)
    }
}

/// A `FIELD=VALUE` argument for [`ScenarioSpec::policy_with`]: the value read as JSON, or
/// as a string when it is not JSON (`objective.kind=risk-budget`).
///
/// # Errors
/// No `=` in the argument.
pub fn parse_set(arg: &str) -> Result<(String, serde_json::Value), String> {
    let (path, value) = arg
        .split_once('=')
        .ok_or_else(|| format!("`{arg}`: expected FIELD=VALUE"))?;
    let value = serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::from(value));
    Ok((path.to_owned(), value))
}

/// The `FIELD=VALUE` arguments of a laboratory example ([`parse_set`]), checked against
/// `label`'s configuration in `spec` before anything runs.
///
/// # Errors
/// An argument without `=`, or one [`ScenarioSpec::policy_with`] refuses (named, with the fix).
pub fn checked_sets(
    spec: &ScenarioSpec,
    label: &str,
    args: &[String],
) -> Result<Vec<(String, serde_json::Value)>, String> {
    let sets = args
        .iter()
        .map(|a| parse_set(a))
        .collect::<Result<Vec<_>, _>>()?;
    spec.policy_with(label, &sets)?;
    Ok(sets)
}

/// The built-in scenarios, as (name, TOML text).
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "websearch-load",
        include_str!("../scenarios/websearch-load.toml"),
    ),
    (
        "strategyqa-hetero",
        include_str!("../scenarios/strategyqa-hetero.toml"),
    ),
    (
        "retriever-pool",
        include_str!("../scenarios/retriever-pool.toml"),
    ),
    ("llm-pool", include_str!("../scenarios/llm-pool.toml")),
    (
        "ramp-ratelimit",
        include_str!("../scenarios/ramp-ratelimit.toml"),
    ),
    (
        "priority-mismatch-k10",
        include_str!("../scenarios/priority-mismatch-k10.toml"),
    ),
    (
        "sudden-ratelimit",
        include_str!("../scenarios/sudden-ratelimit.toml"),
    ),
    (
        "slow-degradation",
        include_str!("../scenarios/slow-degradation.toml"),
    ),
    (
        "latency-spike",
        include_str!("../scenarios/latency-spike.toml"),
    ),
    (
        "outage-recovery",
        include_str!("../scenarios/outage-recovery.toml"),
    ),
    (
        "cold-start-newcomer",
        include_str!("../scenarios/cold-start-newcomer.toml"),
    ),
    ("near-ties", include_str!("../scenarios/near-ties.toml")),
    ("judge-drift", include_str!("../scenarios/judge-drift.toml")),
    (
        "mixed-sla-cost",
        include_str!("../scenarios/mixed-sla-cost.toml"),
    ),
    (
        "bimodal-latency",
        include_str!("../scenarios/bimodal-latency.toml"),
    ),
    ("heavy-tail", include_str!("../scenarios/heavy-tail.toml")),
    ("tail-pair", include_str!("../scenarios/tail-pair.toml")),
    ("llm-tail", include_str!("../scenarios/llm-tail.toml")),
    (
        "flaky-flex-peaks",
        include_str!("../scenarios/flaky-flex-peaks.toml"),
    ),
    (
        "error-burst-recovery",
        include_str!("../scenarios/error-burst-recovery.toml"),
    ),
    (
        "quality-drop-leader",
        include_str!("../scenarios/quality-drop-leader.toml"),
    ),
    (
        "quality-drop-gradual",
        include_str!("../scenarios/quality-drop-gradual.toml"),
    ),
    (
        "quality-drop-minority",
        include_str!("../scenarios/quality-drop-minority.toml"),
    ),
    (
        "capacity-headers",
        include_str!("../scenarios/capacity-headers.toml"),
    ),
    (
        "capacity-retry-after",
        include_str!("../scenarios/capacity-retry-after.toml"),
    ),
];

/// A built-in scenario by name.
///
/// # Errors
/// An unknown name (the message lists the valid ones), or a built-in that fails validation.
pub fn builtin(name: &str) -> Result<ScenarioSpec, ScenarioError> {
    let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == name) else {
        return Err(ScenarioError::Unknown {
            name: name.to_owned(),
            valid: BUILTIN
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", "),
        });
    };
    ScenarioSpec::from_toml(text, &format!("built-in scenario {name}"))
}

/// The scenarios a comma-separated list names: `all` (every built-in), built-in names, and
/// scenario files (ending in `.toml`), in the list's order (the laboratory's examples take
/// their scenarios this way).
///
/// # Errors
/// An unknown name, a file that cannot be read or fails validation.
pub fn named(list: &str) -> Result<Vec<ScenarioSpec>, ScenarioError> {
    if list == "all" {
        return all_builtin();
    }
    list.split(',')
        .map(|n| {
            let is_file = std::path::Path::new(n)
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("toml"));
            if is_file {
                let text = std::fs::read_to_string(n).map_err(|e| ScenarioError::Parse {
                    file: n.to_owned(),
                    field: String::new(),
                    message: format!("cannot be read: {e}"),
                })?;
                ScenarioSpec::from_toml(&text, n)
            } else {
                builtin(n)
            }
        })
        .collect()
}

/// All built-in scenarios.
///
/// # Errors
/// A built-in that fails validation.
pub fn all_builtin() -> Result<Vec<ScenarioSpec>, ScenarioError> {
    BUILTIN.iter().map(|(n, _)| builtin(n)).collect()
}
