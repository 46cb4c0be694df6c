//! A provider's rate limit (`rate_limit = { requests = N, window_ms = W }` on a route): a fixed
//! window of `W` ms that opens at the first call after the last one ended, admitting `N`
//! chat calls. Every answer carries the limit's headers in its dialect's words (OpenAI and
//! Azure: `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
//! `x-ratelimit-reset-requests` as a duration like `850ms`; Anthropic:
//! `anthropic-ratelimit-requests-limit`, `-remaining`, `-reset` as an RFC 3339 time); a call
//! past the limit is a 429 with `Retry-After` (whole seconds, as providers send it) and the
//! same headers. Windows are kept per limited route (bounded by the profile).

use crate::errors::{rate_limited, Speaks};
use crate::profile::RateLimit;
use axum::response::Response;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

/// The open window of each limited route.
#[derive(Debug, Default)]
pub(crate) struct Windows(Mutex<HashMap<String, Window>>);

#[derive(Clone, Copy, Debug)]
struct Window {
    opened: Instant,
    used: u64,
}

/// A call the limit admitted: the headers its answer carries.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Admitted {
    limit: u64,
    remaining: u64,
    reset: Duration,
    speaks: Speaks,
}

impl Windows {
    /// Counts a call of the route `key` limited by `limit`: `Ok` with its headers' values
    /// while the window has room, else the 429.
    pub(crate) fn take(
        &self,
        key: &str,
        limit: &RateLimit,
        speaks: Speaks,
    ) -> Result<Admitted, Box<Response>> {
        let now = Instant::now();
        let length = Duration::from_secs_f64(limit.window_ms / 1000.0);
        let (admitted, used, reset) = {
            let mut windows = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let w = windows.entry(key.to_owned()).or_insert(Window {
                opened: now,
                used: 0,
            });
            if now.duration_since(w.opened) >= length {
                *w = Window {
                    opened: now,
                    used: 0,
                };
            }
            let admitted = w.used < limit.requests;
            w.used += u64::from(admitted);
            (
                admitted,
                w.used,
                length.saturating_sub(now.duration_since(w.opened)),
            )
        };
        let headers = Admitted {
            limit: limit.requests,
            remaining: limit.requests.saturating_sub(used),
            reset,
            speaks,
        };
        if admitted {
            Ok(headers)
        } else {
            let whole_seconds = reset.as_secs_f64().ceil().max(1.0);
            Err(Box::new(
                headers.stamp(rate_limited(speaks, Some(whole_seconds))),
            ))
        }
    }
}

impl Admitted {
    /// Adds the limit's headers to `response`.
    pub(crate) fn stamp(&self, mut response: Response) -> Response {
        let headers = response.headers_mut();
        let mut put = |name: &'static str, value: String| {
            if let Ok(v) = axum::http::HeaderValue::from_str(&value) {
                headers.insert(name, v);
            }
        };
        if self.speaks == Speaks::Anthropic {
            let at = time::OffsetDateTime::from(SystemTime::now() + self.reset)
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default();
            put("anthropic-ratelimit-requests-limit", self.limit.to_string());
            put(
                "anthropic-ratelimit-requests-remaining",
                self.remaining.to_string(),
            );
            put("anthropic-ratelimit-requests-reset", at);
        } else {
            put("x-ratelimit-limit-requests", self.limit.to_string());
            put("x-ratelimit-remaining-requests", self.remaining.to_string());
            put(
                "x-ratelimit-reset-requests",
                format!("{}ms", self.reset.as_millis()),
            );
        }
        response
    }
}
