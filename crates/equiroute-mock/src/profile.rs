//! A mock's profile as written (TOML): per-route latency, error rates and faults ([`Fault`]),
//! per-model overrides, and their checks, each naming the field and the fix.

use equiroute_core::latency::LatencyShapeSpec;
use serde::Deserialize;
use std::collections::BTreeMap;

/// A named fault the mock plays (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    RateLimited,
    RateLimitedNoRetryAfter,
    #[serde(rename = "error_500_once")]
    Error500Once,
    Unavailable,
    Reset,
    NoAnswer,
    SlowFirstToken,
    StreamCut,
    StreamStall,
    MalformedChunk,
    NoDoneFinished,
    NoDoneUnfinished,
    ContextLengthExceeded,
    ContentFilter,
    PrefillRejected,
    Flapping,
    Outage,
    EndlessStream,
    OutageThenRecovers,
    AccessDenied,
}

/// Behaviour of one route (or of one model's chat calls).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteProfile {
    /// The latency before the answer, as the laboratory writes it: a log-normal by `p50_ms`
    /// and `p95_ms` (both 0: no wait at all), optionally with a Pareto `tail`, or a `mixture`
    /// of log-normals.
    pub latency: LatencyShapeSpec,
    pub error_500: f64,
    pub error_503: f64,
    pub error_429: f64,
    /// `Retry-After` seconds sent with a 429 (none when unset; 1 for `fault = "rate_limited"`).
    pub retry_after_s: Option<f64>,
    pub error_400: f64,
    /// Streamed answers: milliseconds between chunks.
    pub chunk_gap_ms: f64,
    /// Streamed answers: break the connection after this many chunks.
    pub stream_cut_after: Option<usize>,
    /// Streamed answers: go silent (forever) after this many chunks.
    pub stream_stall_after: Option<usize>,
    /// The chat answer's text (e.g. a score, to act as an LLM judge).
    pub content: String,
    /// `error.code` of the 400s (e.g. `context_length_exceeded`).
    pub error_400_code: Option<String>,
    /// The fault this route plays on every call (none by default).
    pub fault: Option<Fault>,
    /// `slow_first_token`: milliseconds before the first byte (default 1000).
    pub first_token_delay_ms: Option<f64>,
    /// `outage`: milliseconds after the mock's start during which every call gets a 503
    /// (default 1000).
    pub outage_ms: Option<f64>,
    /// Chat calls: the first this many calls of the model are answered without the fault
    /// (a provider that works, then fails). Default 0.
    pub healthy_calls: u64,
    /// `outage_then_recovers`: the calls `[from, to)` that answer 503 (default `[1, 6)`).
    pub outage_calls: Option<[u64; 2]>,
    /// Faults played at random: each on this share of the calls (shares add up to at most 1).
    pub fault_mix: BTreeMap<Fault, f64>,
    /// `no_answer` and `stream_stall`: milliseconds before the mock closes the connection
    /// (for ever when unset).
    pub hang_ms: Option<f64>,
    /// A rate limit on the route's chat calls, announced in its answers' headers (see
    /// `limits`); none by default.
    pub rate_limit: Option<RateLimit>,
}

/// `rate_limit = { requests = N, window_ms = W }`: `N` chat calls per window of `W` ms.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    pub requests: u64,
    #[serde(default = "default_window_ms")]
    pub window_ms: f64,
}

fn default_window_ms() -> f64 {
    60_000.0
}

impl Default for RouteProfile {
    fn default() -> Self {
        RouteProfile {
            latency: LatencyShapeSpec::log_normal(20.0, 20.0),
            error_500: 0.0,
            error_503: 0.0,
            error_429: 0.0,
            retry_after_s: None,
            error_400: 0.0,
            chunk_gap_ms: 5.0,
            stream_cut_after: None,
            stream_stall_after: None,
            content: "mock answer".to_owned(),
            error_400_code: None,
            fault: None,
            first_token_delay_ms: None,
            outage_ms: None,
            healthy_calls: 0,
            outage_calls: None,
            fault_mix: BTreeMap::new(),
            hang_ms: None,
            rate_limit: None,
        }
    }
}

/// Behaviour of the whole mock.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MockProfile {
    pub chat: RouteProfile,
    pub search: RouteProfile,
    /// Chat calls whose request `model` is a key here are served by its profile instead of
    /// `chat`.
    pub models: BTreeMap<String, RouteProfile>,
}

impl MockProfile {
    /// Parses a profile; `file` names it in errors.
    ///
    /// # Errors
    /// Syntax errors, unknown fields and values out of range, with the field named.
    pub fn from_toml(text: &str, file: &str) -> Result<MockProfile, String> {
        let profile: MockProfile =
            equiroute_toml::parse(text).map_err(|p| format!("{file}: `{}`: {}", p.field, p.fix))?;
        let routes = [
            ("chat".to_owned(), &profile.chat),
            ("search".to_owned(), &profile.search),
        ];
        let models = profile
            .models
            .iter()
            .map(|(name, route)| (format!("models.{name}"), route));
        for (name, route) in routes.into_iter().chain(models) {
            check_latency(&route.latency)
                .map_err(|(sub, fix)| format!("{file}: `{name}.latency{sub}`: {fix}"))?;
            route
                .check()
                .map_err(|(field, fix)| format!("{file}: `{name}.{field}`: {fix}"))?;
        }
        Ok(profile)
    }

    /// The profile that serves a chat call for `model`.
    pub(crate) fn chat_for(&self, model: Option<&str>) -> &RouteProfile {
        model.and_then(|m| self.models.get(m)).unwrap_or(&self.chat)
    }
}

/// A route's latency: the laboratory's shapes, plus `p50_ms = p95_ms = 0` (no wait, the
/// throughput benchmark's upstream).
/// On error: the sub-field after `latency` (`""` for the table) and the fix.
pub(crate) fn check_latency(l: &LatencyShapeSpec) -> Result<(), (String, String)> {
    let no_wait = l.p50_ms == Some(0.0) && l.p95_ms == Some(0.0);
    if no_wait && l.tail.is_none() && l.mixture.is_empty() {
        return Ok(());
    }
    l.check()
}

impl RouteProfile {
    /// The first field out of range, and what it must be.
    fn check(&self) -> Result<(), (&'static str, String)> {
        let rates = [
            ("error_500", self.error_500),
            ("error_503", self.error_503),
            ("error_429", self.error_429),
            ("error_400", self.error_400),
        ];
        for (field, r) in rates {
            if !(0.0..=1.0).contains(&r) {
                return Err((field, format!("a probability from 0 to 1, got {r}")));
            }
        }
        let total: f64 = rates.iter().map(|(_, r)| r).sum();
        if total > 1.0 + 1e-9 {
            return Err((
                "error_500",
                format!(
                    "error_500 + error_503 + error_429 + error_400 must be at most 1, got {total}"
                ),
            ));
        }
        if !(self.chunk_gap_ms >= 0.0 && self.chunk_gap_ms.is_finite()) {
            return Err((
                "chunk_gap_ms",
                format!("milliseconds ≥ 0, got {}", self.chunk_gap_ms),
            ));
        }
        if let Some(l) = self.rate_limit {
            if l.requests == 0 {
                return Err(("rate_limit.requests", "at least 1 call per window".into()));
            }
            if !(l.window_ms > 0.0 && l.window_ms.is_finite()) {
                return Err((
                    "rate_limit.window_ms",
                    format!("milliseconds > 0 (default 60000), got {}", l.window_ms),
                ));
            }
        }
        if let Some(s) = self.retry_after_s.filter(|s| !(*s >= 0.0 && s.is_finite())) {
            return Err(("retry_after_s", format!("seconds ≥ 0, got {s}")));
        }
        if let Some(d) = self
            .first_token_delay_ms
            .filter(|d| !(*d >= 0.0 && d.is_finite()))
        {
            return Err(("first_token_delay_ms", format!("milliseconds ≥ 0, got {d}")));
        }
        if let Some(h) = self.hang_ms.filter(|h| !(*h >= 0.0 && h.is_finite())) {
            return Err(("hang_ms", format!("milliseconds ≥ 0, got {h}")));
        }
        self.check_fault_mix()
    }

    /// `fault_mix`: shares in [0, 1] adding up to at most 1, no history-dependent fault, and
    /// not together with `fault`.
    fn check_fault_mix(&self) -> Result<(), (&'static str, String)> {
        if self.fault_mix.is_empty() {
            return Ok(());
        }
        if let Some(f) = self.fault {
            return Err((
                "fault_mix",
                format!("cannot be combined with `fault = {f:?}`: keep one of the two"),
            ));
        }
        for (fault, share) in &self.fault_mix {
            if matches!(
                fault,
                Fault::Error500Once | Fault::Flapping | Fault::Outage | Fault::OutageThenRecovers
            ) {
                return Err((
                    "fault_mix",
                    format!("{fault:?} depends on the call history, which a random mix has not: use error_500 for random 500s"),
                ));
            }
            if !(0.0..=1.0).contains(share) {
                return Err((
                    "fault_mix",
                    format!("{fault:?}: a share from 0 to 1, got {share}"),
                ));
            }
        }
        let total: f64 = self.fault_mix.values().sum();
        if total > 1.0 + 1e-9 {
            return Err((
                "fault_mix",
                format!("the shares must add up to at most 1, got {total}"),
            ));
        }
        if let Some(d) = self.outage_ms.filter(|d| !(*d >= 0.0 && d.is_finite())) {
            return Err(("outage_ms", format!("milliseconds ≥ 0, got {d}")));
        }
        Ok(())
    }
}
