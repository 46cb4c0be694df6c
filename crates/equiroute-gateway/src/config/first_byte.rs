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
}

impl Default for FirstByteLimit {
    fn default() -> Self {
        FirstByteLimit {
            learned: true,
            quantile: 0.99,
            factor: 3.0,
            floor_ms: 1000.0,
            min_observations: 5,
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
        if self.min_observations == 0 {
            return Err(("min_observations", "must be at least 1 (default 5)".into()));
        }
        Ok(())
    }
}

/// How much of a streamed answer is held before anything is sent to the client
/// (`stream_hold` of an interface): while held, a stream that breaks, stalls or starts
/// malformed falls back to the next provider invisibly. The hold ends at the first of `ms`
/// after the first byte, `events` data events (0: no limit by count), [`Self::MAX_BYTES`]
/// held, or the end of the answer. The default, `ms = 0`, sends from the first byte.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamHold {
    pub ms: f64,
    pub events: u64,
}

impl Default for StreamHold {
    fn default() -> Self {
        StreamHold { ms: 0.0, events: 0 }
    }
}

impl StreamHold {
    /// The most bytes a hold keeps before it sends them (a bound on memory per stream).
    pub const MAX_BYTES: usize = 256 * 1024;

    /// Whether streams are held at all.
    #[must_use]
    pub fn is_on(&self) -> bool {
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
