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
