//! Types shared by every layer: units, candidates, requests, attempt outcomes, feedback.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// A duration in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Millis(pub f64);

/// A point in time, in milliseconds since an epoch chosen by the caller (wall clock in the
/// gateway, virtual clock in the laboratory). Only differences matter to the core.
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(pub f64);

impl Timestamp {
    /// The time `d` after `self`.
    #[must_use]
    pub fn plus(self, d: Millis) -> Timestamp {
        Timestamp(self.0 + d.0)
    }
    /// Milliseconds elapsed from `earlier` to `self` (0 when `earlier` is later).
    #[must_use]
    pub fn since(self, earlier: Timestamp) -> Millis {
        Millis((self.0 - earlier.0).max(0.0))
    }
}

/// Money in US dollars.
#[derive(Clone, Copy, Debug, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Usd(pub f64);

/// The stable identifier of a candidate inside its interface (e.g. `openai-flex`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CandidateId(pub String);

impl fmt::Display for CandidateId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A provider's service tier: the same model at a different price and latency.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ServiceTier {
    Flex,
    #[default]
    Standard,
    Priority,
}

/// What a candidate can do. Eligibility compares it with a request's [`Requirements`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Capabilities {
    pub tools: bool,
    pub json_mode: bool,
    pub streaming: bool,
    pub vision: bool,
    pub audio: bool,
    /// Largest context window in tokens.
    pub context_tokens: u32,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            tools: true,
            json_mode: true,
            streaming: true,
            vision: false,
            audio: false,
            context_tokens: 128_000,
        }
    }
}

/// What a request needs from a candidate.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Requirements {
    pub tools: bool,
    pub json_mode: bool,
    pub streaming: bool,
    pub vision: bool,
    pub audio: bool,
    /// Prompt plus expected completion, in tokens.
    pub context_tokens: u32,
}

/// Price of one call: a fixed part plus per-token parts (per million tokens, the way
/// providers publish them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Price {
    pub per_call: Usd,
    pub per_million_input_tokens: Usd,
    pub per_million_output_tokens: Usd,
}

impl Price {
    /// A flat price per call.
    #[must_use]
    pub fn per_call(usd: f64) -> Price {
        Price {
            per_call: Usd(usd),
            ..Price::default()
        }
    }

    /// Checks every part is a finite amount of at least 0 (a negative price would make a
    /// provider look like it pays for its calls, and cost-aware policies prefer it).
    ///
    /// # Errors
    /// The first part that is not, named as the configuration names it.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        crate::error::non_negative("per_call", self.per_call.0)?;
        crate::error::non_negative("per_million_input_tokens", self.per_million_input_tokens.0)?;
        crate::error::non_negative(
            "per_million_output_tokens",
            self.per_million_output_tokens.0,
        )?;
        Ok(())
    }

    /// Expected cost of a call with the given token counts.
    #[must_use]
    pub fn cost(&self, tokens: TokenEstimate) -> Usd {
        Usd(self.per_call.0
            + self.per_million_input_tokens.0 * f64::from(tokens.input) / 1e6
            + self.per_million_output_tokens.0 * f64::from(tokens.output) / 1e6)
    }
}

/// Token counts of a call (estimated before, measured after).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenEstimate {
    pub input: u32,
    pub output: u32,
}

impl TokenEstimate {
    /// Input and output tokens together.
    #[must_use]
    pub fn total(&self) -> u64 {
        u64::from(self.input) + u64::from(self.output)
    }
}

/// One concrete upstream: provider × model × service tier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub id: CandidateId,
    pub provider: String,
    pub model: String,
    pub tier: ServiceTier,
    pub price: Price,
    pub capabilities: Capabilities,
    /// Free-form labels matched by eligibility, e.g. `region = "eu"`.
    pub labels: BTreeMap<String, String>,
    /// Tenants allowed to use this candidate; `None` allows every tenant.
    pub tenants: Option<Vec<String>>,
    /// Spending cap for this candidate over the caller's accounting period.
    pub spend_cap: Option<Usd>,
    /// The operator's preference: among candidates that tie on evidence and price, the
    /// higher goes first (0 by default).
    #[serde(default)]
    pub preference: i32,
}

impl Candidate {
    /// A candidate with default capabilities, standard tier, free, unlabelled.
    #[must_use]
    pub fn new(id: &str, provider: &str, model: &str) -> Candidate {
        Candidate {
            id: CandidateId(id.to_owned()),
            provider: provider.to_owned(),
            model: model.to_owned(),
            tier: ServiceTier::Standard,
            price: Price::default(),
            capabilities: Capabilities::default(),
            labels: BTreeMap::new(),
            tenants: None,
            spend_cap: None,
            preference: 0,
        }
    }

    /// The same candidate with a price.
    #[must_use]
    pub fn with_price(mut self, price: Price) -> Candidate {
        self.price = price;
        self
    }

    /// The same candidate with a service tier.
    #[must_use]
    pub fn with_tier(mut self, tier: ServiceTier) -> Candidate {
        self.tier = tier;
        self
    }
}

/// Why a provider-side failure happened. All of them count against the provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderFailure {
    /// HTTP 429 or a quota error.
    RateLimited,
    /// HTTP 5xx.
    Server,
    /// Connection refused, reset, TLS or DNS failure.
    Connection,
    /// A stream that broke after it started.
    StreamBroken,
}

/// How an attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "status", content = "kind")]
pub enum AttemptStatus {
    /// The provider answered.
    Ok,
    /// The provider failed: counts against it.
    ProviderError(ProviderFailure),
    /// The request was malformed or refused by policy: does not count against the provider.
    ClientError,
    /// Cancelled at the deadline: the true latency is at least the recorded latency (censored).
    Timeout,
    /// Cancelled for another reason (client went away, a hedge won): also censored.
    Cancelled,
}

impl AttemptStatus {
    /// Whether this outcome counts as a provider-side failure.
    #[must_use]
    pub fn is_provider_failure(self) -> bool {
        matches!(self, AttemptStatus::ProviderError(_))
    }

    /// Whether the recorded latency is only a lower bound of the true latency.
    #[must_use]
    pub fn is_censored(self) -> bool {
        matches!(self, AttemptStatus::Timeout | AttemptStatus::Cancelled)
    }

    /// A short lowercase name for metrics and logs.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptStatus::Ok => "ok",
            AttemptStatus::ProviderError(_) => "provider_error",
            AttemptStatus::ClientError => "client_error",
            AttemptStatus::Timeout => "timeout",
            AttemptStatus::Cancelled => "cancelled",
        }
    }
}

/// What one attempt on one provider produced.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttemptOutcome {
    /// Observed latency; for `Timeout` and `Cancelled` the time at which it was cut off.
    pub latency: Millis,
    pub status: AttemptStatus,
    /// What the attempt cost, failed attempts included.
    pub cost: Usd,
    /// Time to first byte, for streamed responses.
    pub time_to_first_byte: Option<Millis>,
    /// A provider's `Retry-After`, when it sent one.
    pub retry_after: Option<Millis>,
}

impl AttemptOutcome {
    /// Whether this is a provider resting rather than failing: an unbilled rate limit that
    /// says when to come back (`Retry-After`). Its breaker keeps the provider out until then
    /// and a fallback answers the request, so the policies' failure rates leave it out: it
    /// cost its latency, not a bad outcome. A rate limit without `Retry-After`, or a billed
    /// one, still counts as a failure.
    #[must_use]
    pub fn is_rest(&self) -> bool {
        self.status == AttemptStatus::ProviderError(ProviderFailure::RateLimited)
            && self.retry_after.is_some()
            && self.cost.0 == 0.0
    }

    /// A successful attempt with the given latency and no cost.
    #[must_use]
    pub fn ok(latency_ms: f64) -> AttemptOutcome {
        AttemptOutcome::with_status(latency_ms, AttemptStatus::Ok)
    }

    /// An attempt with the given latency and status and no cost.
    #[must_use]
    pub fn with_status(latency_ms: f64, status: AttemptStatus) -> AttemptOutcome {
        AttemptOutcome {
            latency: Millis(latency_ms),
            status,
            cost: Usd(0.0),
            time_to_first_byte: None,
            retry_after: None,
        }
    }
}

/// Who produced a quality score.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FeedbackSource {
    Judge,
    User,
    Api,
    Gold,
}

/// A quality score in `[0, 1]` that may arrive long after the request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QualityFeedback {
    pub decision_id: u64,
    pub quality: f64,
    pub source: FeedbackSource,
}

/// Labels that pick the statistics slice of a request (see [`SlicePath`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SliceLabels {
    /// e.g. `rerank`, `extract`, `chat`.
    pub task_class: Option<String>,
    /// e.g. `interactive`; derive one from a deadline with [`deadline_class`].
    pub deadline_class: Option<String>,
    pub streaming: bool,
    /// Input size bucket; derive one from a token count with [`input_size_bucket`].
    pub input_bucket: Option<u8>,
}

/// A deadline class name for a deadline: `none`, `<1s`, `<5s`, `<30s` or `long`.
#[must_use]
pub fn deadline_class(deadline: Option<Millis>) -> &'static str {
    match deadline {
        None => "none",
        Some(d) if d.0 <= 1_000.0 => "<1s",
        Some(d) if d.0 <= 5_000.0 => "<5s",
        Some(d) if d.0 <= 30_000.0 => "<30s",
        Some(_) => "long",
    }
}

/// A power-of-four input-size bucket: 0 for up to 256 tokens, then one per factor of 4.
#[must_use]
pub fn input_size_bucket(input_tokens: u32) -> u8 {
    let mut bucket = 0u8;
    let mut limit = 256u64;
    while u64::from(input_tokens) > limit && bucket < 8 {
        bucket += 1;
        limit *= 4;
    }
    bucket
}

/// The chain of statistics slices a request belongs to, from the most general (level 0: all
/// requests of a candidate) to the most specific (task class + deadline class + streaming +
/// input bucket). Each level is a stable 64-bit key; a sparse level borrows strength from the
/// level before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SlicePath {
    keys: [u64; SlicePath::MAX_DEPTH],
    depth: u8,
}

impl Default for SlicePath {
    fn default() -> Self {
        SlicePath::root()
    }
}

impl SlicePath {
    /// Levels: all, + task class, + deadline class, + streaming and input bucket.
    pub const MAX_DEPTH: usize = 4;

    /// The path with only the root level.
    #[must_use]
    pub fn root() -> SlicePath {
        SlicePath {
            keys: [0; Self::MAX_DEPTH],
            depth: 1,
        }
    }

    /// The path of a request's labels, truncated to `max_depth` levels (1 = no slicing).
    #[must_use]
    pub fn from_labels(labels: &SliceLabels, max_depth: usize) -> SlicePath {
        SlicePath::from_parts(
            labels.task_class.as_deref(),
            labels.deadline_class.as_deref(),
            labels.streaming,
            labels.input_bucket,
            max_depth,
        )
    }

    /// [`SlicePath::from_labels`] from borrowed parts (no allocation on the request path).
    #[must_use]
    pub fn from_parts(
        task_class: Option<&str>,
        deadline_class: Option<&str>,
        streaming: bool,
        input_bucket: Option<u8>,
        max_depth: usize,
    ) -> SlicePath {
        let depth = max_depth.clamp(1, Self::MAX_DEPTH);
        let mut keys = [0u64; Self::MAX_DEPTH];
        let mut h = Self::task_level(task_class);
        keys[1] = h.finish() | 1;
        h.write(b"|deadline:");
        h.write(deadline_class.unwrap_or("").as_bytes());
        keys[2] = h.finish() | 1;
        h.write(b"|stream:");
        h.write(&[u8::from(streaming), input_bucket.unwrap_or(u8::MAX)]);
        keys[3] = h.finish() | 1;
        SlicePath {
            keys,
            depth: depth as u8,
        }
    }

    /// The hash of the task-class level (no class and an empty one are the same).
    fn task_level(task_class: Option<&str>) -> crate::features::Fnv64 {
        let mut h = crate::features::Fnv64::new();
        h.write(b"task:");
        h.write(task_class.unwrap_or("").as_bytes());
        h
    }

    /// Whether the request had a task class. The slices of requests without one are a few
    /// per deadline class, streaming and input size, which a client cannot multiply, so they
    /// are evicted last.
    #[must_use]
    pub fn has_task_class(&self) -> bool {
        self.depth > 1 && self.keys[1] != Self::task_level(None).finish() | 1
    }

    /// The keys from the root down to the most specific level.
    #[must_use]
    pub fn levels(&self) -> &[u64] {
        &self.keys[..usize::from(self.depth)]
    }
}
