//! What a provider's rate-limit headers say is left of its capacity, read from every answer:
//! OpenAI's and Azure's `x-ratelimit-remaining-requests` / `-tokens` with
//! `x-ratelimit-reset-requests` / `-tokens` (a duration: `20ms`, `1s`, `6m0s`), Anthropic's
//! `anthropic-ratelimit-requests-remaining` / `-tokens-remaining` with `…-reset` (an RFC 3339
//! time). A provider with nothing left for a request like the one just made is rested until
//! its reset, as after a `Retry-After` (see `server::attempt::outcome_of`): the next requests
//! go to the others instead of taking a 429 and a wait. Limits are the key's, global: every
//! instance reads the same headers, and a rest is shared through Redis like a `Retry-After`.

use equiroute_core::Millis;
use http::{HeaderMap, HeaderName};

/// One limit: what is left of it, and how long until it is replenished (when said).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Left {
    pub remaining: u64,
    pub reset: Option<Millis>,
}

/// What an answer's headers said of the provider's capacity (nothing, for most answers).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Capacity {
    pub requests: Option<Left>,
    pub tokens: Option<Left>,
}

/// The rest of a provider that says nothing is left without saying until when (Azure may
/// send the remaining counts alone).
const UNSAID_RESET: Millis = Millis(1000.0);

// Each limit's remaining count and reset, as header names made once (a name given as text is
// parsed again at every lookup, and these are looked up in every answer).
const OPENAI_REQUESTS: [HeaderName; 2] = [
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
];
const OPENAI_TOKENS: [HeaderName; 2] = [
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
];
const ANTHROPIC_REQUESTS: [HeaderName; 2] = [
    HeaderName::from_static("anthropic-ratelimit-requests-remaining"),
    HeaderName::from_static("anthropic-ratelimit-requests-reset"),
];
const ANTHROPIC_TOKENS: [HeaderName; 2] = [
    HeaderName::from_static("anthropic-ratelimit-tokens-remaining"),
    HeaderName::from_static("anthropic-ratelimit-tokens-reset"),
];

impl Capacity {
    /// Reads `headers`; `now_unix_ms` turns Anthropic's reset times into waits.
    #[must_use]
    pub fn of(headers: &HeaderMap, now_unix_ms: f64) -> Capacity {
        // Most answers carry none of them: one pass over the names saves eight lookups.
        let announced = |name: &HeaderName| {
            let name = name.as_str();
            name.starts_with("x-ratelimit-") || name.starts_with("anthropic-ratelimit-")
        };
        if !headers.keys().any(announced) {
            return Capacity::default();
        }
        let text = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
        let left = |[remaining, reset]: &[HeaderName; 2], at_time: bool| {
            let remaining = text(remaining)?.trim().parse::<u64>().ok()?;
            let reset = text(reset).and_then(|r| {
                if at_time {
                    rfc3339_unix_ms(r).map(|at| Millis((at - now_unix_ms).max(0.0)))
                } else {
                    duration(r)
                }
            });
            Some(Left { remaining, reset })
        };
        let openai = Capacity {
            requests: left(&OPENAI_REQUESTS, false),
            tokens: left(&OPENAI_TOKENS, false),
        };
        if openai != Capacity::default() {
            return openai;
        }
        Capacity {
            requests: left(&ANTHROPIC_REQUESTS, true),
            tokens: left(&ANTHROPIC_TOKENS, true),
        }
    }

    /// How long the provider has no capacity for another request of `tokens` tokens (the
    /// one just made, as the best guess of the next): until the later reset of the limits
    /// that have nothing left (no requests, or fewer tokens than `tokens`); `None` when it has
    /// (or the reset is already past).
    #[must_use]
    pub fn exhausted_for(&self, tokens: u64) -> Option<Millis> {
        let requests = self
            .requests
            .filter(|l| l.remaining == 0)
            .map(|l| l.reset.unwrap_or(UNSAID_RESET));
        let tokens = self
            .tokens
            .filter(|l| l.remaining < tokens.max(1))
            .map(|l| l.reset.unwrap_or(UNSAID_RESET));
        later(requests, tokens).filter(|w| w.0 > 0.0)
    }
}

/// The limit that left a provider without capacity (`server::capacity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// `max_concurrency`: as many requests in flight as declared.
    Concurrency,
    /// `rpm`: as many requests in the last 60 s as declared.
    Requests,
    /// `tpm`: as many tokens in the last 60 s as declared.
    Tokens,
    /// The provider's headers said no request is left until their reset.
    Announced,
}

impl Limit {
    /// Its label in `equiroute_capacity_skips_total`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Concurrency => "max_concurrency",
            Limit::Requests => "rpm",
            Limit::Tokens => "tpm",
            Limit::Announced => "announced",
        }
    }
}

/// The declared caps among `caps`' limits (`max_concurrency`, `rpm`, `tpm`), in that order.
#[must_use]
pub fn declared(caps: &crate::config::Caps) -> Vec<Limit> {
    [
        (Limit::Concurrency, caps.max_concurrency),
        (Limit::Requests, caps.rpm),
        (Limit::Tokens, caps.tpm),
    ]
    .into_iter()
    .filter_map(|(limit, cap)| cap.map(|_| limit))
    .collect()
}

/// The longer of two waits, either of which may be unsaid.
#[must_use]
pub fn later(a: Option<Millis>, b: Option<Millis>) -> Option<Millis> {
    either(a, b, f64::max)
}

/// The shorter of two waits, either of which may be unsaid.
#[must_use]
pub fn sooner(a: Option<Millis>, b: Option<Millis>) -> Option<Millis> {
    either(a, b, f64::min)
}

/// `pick` of two waits when both are said, else the one that is.
fn either(a: Option<Millis>, b: Option<Millis>, pick: fn(f64, f64) -> f64) -> Option<Millis> {
    match (a, b) {
        (Some(a), Some(b)) => Some(Millis(pick(a.0, b.0))),
        (a, b) => a.or(b),
    }
}

/// OpenAI's durations (`20ms`, `1s`, `1.5s`, `6m0s`, `1h2m3s`), or a bare number of seconds.
fn duration(text: &str) -> Option<Millis> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then_some(Millis(seconds * 1000.0));
    }
    if text.is_empty() {
        return None;
    }
    let (mut total, mut rest) = (0.0, text);
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|&i| i > 0)?;
        let value: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let (unit, len) = if rest.starts_with("ms") {
            (1.0, 2)
        } else {
            match rest.chars().next()? {
                'h' => (3_600_000.0, 1),
                'm' => (60_000.0, 1),
                's' => (1000.0, 1),
                _ => return None,
            }
        };
        total += value * unit;
        rest = &rest[len..];
    }
    Some(Millis(total))
}

/// An RFC 3339 time (`2026-12-06T16:52:00Z`, `…00.250+01:00`) in milliseconds since the Unix
/// epoch.
fn rfc3339_unix_ms(text: &str) -> Option<f64> {
    let at =
        time::OffsetDateTime::parse(text.trim(), &time::format_description::well_known::Rfc3339)
            .ok()?;
    Some(at.unix_timestamp_nanos() as f64 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn openai_durations_read_as_milliseconds() {
        assert_eq!(duration("20ms"), Some(Millis(20.0)));
        assert_eq!(duration("1s"), Some(Millis(1000.0)));
        assert_eq!(duration("1.5s"), Some(Millis(1500.0)));
        assert_eq!(duration("6m0s"), Some(Millis(360_000.0)));
        assert_eq!(duration("1h2m3s"), Some(Millis(3_723_000.0)));
        assert_eq!(duration("2"), Some(Millis(2000.0)));
        for bad in ["", "s", "1x", "-1", "1s2"] {
            assert_eq!(duration(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn openai_headers_with_no_requests_left_rest_the_provider_until_the_reset() {
        let h = headers(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "850ms"),
            ("x-ratelimit-remaining-tokens", "39000"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ]);
        let c = Capacity::of(&h, 0.0);
        assert_eq!(
            c.requests,
            Some(Left {
                remaining: 0,
                reset: Some(Millis(850.0))
            })
        );
        assert_eq!(c.exhausted_for(500), Some(Millis(850.0)));
        // Tokens short of the request's as well: the later of the two resets.
        assert_eq!(c.exhausted_for(40_000), Some(Millis(360_000.0)));
        // Requests left, tokens enough: nothing to wait for.
        let h = headers(&[("x-ratelimit-remaining-requests", "3")]);
        assert_eq!(Capacity::of(&h, 0.0).exhausted_for(500), None);
        // None left and no reset said: a short rest.
        let h = headers(&[("x-ratelimit-remaining-requests", "0")]);
        assert_eq!(Capacity::of(&h, 0.0).exhausted_for(1), Some(UNSAID_RESET));
        assert_eq!(Capacity::of(&HeaderMap::new(), 0.0), Capacity::default());
    }

    #[test]
    fn anthropic_reset_times_are_waits_from_now() {
        // 2026-12-06T16:52:00Z is 1,796,575,920 s after the epoch.
        let now = 1_796_575_920_000.0 - 1500.0;
        let h = headers(&[
            ("anthropic-ratelimit-requests-remaining", "0"),
            ("anthropic-ratelimit-requests-reset", "2026-12-06T16:52:00Z"),
            ("anthropic-ratelimit-tokens-remaining", "100"),
            (
                "anthropic-ratelimit-tokens-reset",
                "2026-12-06T17:52:00.500+01:00",
            ),
        ]);
        let c = Capacity::of(&h, now);
        assert_eq!(c.exhausted_for(10), Some(Millis(1500.0)));
        assert_eq!(c.exhausted_for(200), Some(Millis(2000.0)));
        // A reset already past: no wait.
        assert_eq!(Capacity::of(&h, now + 10_000.0).exhausted_for(10), None);
    }
}
