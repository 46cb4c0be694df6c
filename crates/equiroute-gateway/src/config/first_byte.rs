//! The `first_byte` settings of an interface (see `server::ttfb` for how the limit is
//! derived from them).

use serde::Deserialize;

/// How the limit is derived (`first_byte` of an interface).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FirstByteLimit {
    /// Derive the limit at all (false: the attempt's timeout, as before).
    pub learned: bool,
    /// The predictive quantile of the provider's first-byte time that is multiplied.
    pub quantile: f64,
    pub factor: f64,
    /// The shortest limit ever derived.
    pub floor_ms: f64,
    /// First bytes seen before the limit is derived.
    pub min_observations: u64,
    /// Plan a streamed request's hedge delay on the first-byte belief (false: on the
    /// whole-answer latency beliefs, as an unstreamed request's; the limit is unchanged).
    pub plan_hedges: bool,
    /// The limit before the provider's first bytes are known and while another candidate is
    /// left, when the interface's providers together have not `min_observations` first bytes
    /// either (else it is derived from theirs).
    pub unlearnt_ms: f64,
    /// The share of the time left before the deadline that an attempt with an unlearnt limit
    /// may wait for its first byte (the rest is for the next candidate).
    pub deadline_share: f64,
}

impl Default for FirstByteLimit {
    fn default() -> Self {
        FirstByteLimit {
            learned: true,
            quantile: 0.99,
            factor: 3.0,
            floor_ms: 1000.0,
            min_observations: 5,
            plan_hedges: true,
            unlearnt_ms: 5000.0,
            deadline_share: 0.5,
        }
    }
}

impl FirstByteLimit {
    /// The first field out of range, and its fix.
    ///
    /// # Errors
    /// `(field, fix)`.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(self.quantile > 0.5 && self.quantile < 1.0) {
            return Err((
                "quantile",
                format!(
                    "must be above 0.5 and below 1 (default 0.99), got {}",
                    self.quantile
                ),
            ));
        }
        if !(self.factor.is_finite() && self.factor >= 1.0) {
            return Err((
                "factor",
                format!(
                    "must be a finite number of at least 1 (default 3), got {}",
                    self.factor
                ),
            ));
        }
        if !(self.floor_ms.is_finite() && self.floor_ms > 0.0) {
            return Err((
                "floor_ms",
                format!(
                    "must be a positive number of ms (default 1000), got {}",
                    self.floor_ms
                ),
            ));
        }
        if !(self.unlearnt_ms.is_finite() && self.unlearnt_ms > 0.0) {
            return Err((
                "unlearnt_ms",
                format!(
                    "must be a positive number of ms (default 5000), got {}",
                    self.unlearnt_ms
                ),
            ));
        }
        if !(self.deadline_share > 0.0 && self.deadline_share <= 1.0) {
            return Err((
                "deadline_share",
                format!(
                    "must be above 0 and at most 1 (default 0.5), got {}",
                    self.deadline_share
                ),
            ));
        }
        if self.min_observations == 0 {
            return Err(("min_observations", "must be at least 1 (default 5)".into()));
        }
        Ok(())
    }
}

/// How much of a streamed answer is held before anything is sent to the client
/// (`stream_hold` of an interface): while held, a stream that breaks, stalls or starts
/// malformed falls back to the next provider invisibly. With `until_content` (the default)
/// the events before the first one that carries content (role-only or empty deltas) are
/// held, which costs no time to the first token; `ms > 0` holds on for `ms` after the first
/// byte or until `events` data events (0: no limit by count). Whatever is configured, the
/// hold ends at [`Self::MAX_BYTES`] held or the end of the answer.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamHold {
    pub ms: f64,
    pub events: u64,
    pub until_content: bool,
}

impl Default for StreamHold {
    fn default() -> Self {
        StreamHold {
            ms: 0.0,
            events: 0,
            until_content: true,
        }
    }
}

impl StreamHold {
    /// The most bytes a hold keeps before it sends them (a bound on memory per stream).
    pub const MAX_BYTES: usize = 256 * 1024;

    /// Whether streams are held at all.
    #[must_use]
    pub fn is_on(&self) -> bool {
        self.until_content || self.is_timed()
    }

    /// Whether the hold lasts `ms` (or `events`) past the first byte.
    #[must_use]
    pub fn is_timed(&self) -> bool {
        self.ms > 0.0
    }

    /// The first field out of range, and its fix.
    ///
    /// # Errors
    /// `(field, fix)`.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(self.ms.is_finite() && (0.0..=60_000.0).contains(&self.ms)) {
            return Err((
                "ms",
                format!(
                    "must be a number of ms from 0 (no hold, the default) to 60000, got {}",
                    self.ms
                ),
            ));
        }
        if self.events > 100_000 {
            return Err((
                "events",
                format!(
                    "must be at most 100000 (0: no limit by count), got {}",
                    self.events
                ),
            ));
        }
        Ok(())
    }
}

/// How a stream that breaks after it was committed goes on (`stream_resume` of an
/// interface): not at all (`off`: it ends with the `stream_broken` error event), or on the
/// next candidate of the ranking, announced in the stream by a marker event: `prefix` (the
/// default) sends the partial answer as a final assistant message to a provider that takes
/// one (`assistant_prefill`) and appends its deltas; `restart` sends the original request and
/// relays the new answer whole after the marker. A restart follows content only for a client
/// that asks for restart events (see `server::execute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamResume {
    pub mode: ResumeMode,
    /// Continuations per request.
    pub max: u32,
    /// The most assistant text kept for a continuation; an answer longer than this is not
    /// continued (a bound on memory per stream).
    pub max_kept_bytes: usize,
}

/// What [`StreamResume`] does with a broken stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    Off,
    #[default]
    Prefix,
    Restart,
}

impl ResumeMode {
    /// The mode's name in the configuration, the audit log and the metrics.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ResumeMode::Off => "off",
            ResumeMode::Prefix => "prefix",
            ResumeMode::Restart => "restart",
        }
    }
}

impl Default for StreamResume {
    fn default() -> Self {
        StreamResume {
            mode: ResumeMode::Prefix,
            max: 1,
            max_kept_bytes: 64 * 1024,
        }
    }
}

impl StreamResume {
    /// The largest `max_kept_bytes` accepted.
    pub const MAX_KEPT_BYTES: usize = 1 << 20;
    /// The largest `max` accepted.
    pub const MAX_CONTINUATIONS: u32 = 3;

    /// Whether broken streams are continued at all.
    #[must_use]
    pub fn is_on(&self) -> bool {
        self.mode != ResumeMode::Off
    }

    /// The first field out of range, and its fix.
    ///
    /// # Errors
    /// `(field, fix)`.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(1..=Self::MAX_CONTINUATIONS).contains(&self.max) {
            return Err((
                "max",
                format!(
                    "must be from 1 (the default) to {}, got {}",
                    Self::MAX_CONTINUATIONS,
                    self.max
                ),
            ));
        }
        if !(1..=Self::MAX_KEPT_BYTES).contains(&self.max_kept_bytes) {
            return Err((
                "max_kept_bytes",
                format!(
                    "must be from 1 to {} (default 65536), got {}",
                    Self::MAX_KEPT_BYTES,
                    self.max_kept_bytes
                ),
            ));
        }
        Ok(())
    }
}
