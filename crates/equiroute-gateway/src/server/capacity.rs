//! A provider's capacity as the gateway keeps it: the caps the operator declares (`rpm`,
//! `tpm`, `max_concurrency`) and what the provider's rate-limit headers last said is left
//! ([`crate::upstream::limits`]), counted down by every request sent since. An attempt takes a
//! [`Permit`] before it goes; a provider with no capacity left is skipped for the next
//! candidate (no 429 taken, no wait), and counted in `equiroute_capacity_skips_total`.
//!
//! Requests and tokens are counted per second over the last 60 s (a ring of 60 seconds): a
//! cap is never exceeded in any 60 s, whatever window the provider counts in (a fixed
//! minute, a rolling one, or a token bucket refilled over the minute). With `[state] backend
//! = "redis"` the counts live in Redis (one hash per provider, updated by a Lua script on
//! Redis's clock), so every instance using the key stays within the one limit together; when
//! Redis does not answer within `claim_timeout_ms` the instance counts alone. Requests in
//! flight are counted per instance.

use crate::config::Caps;
use crate::upstream::limits::{Capacity, Limit};
use equiroute_core::Millis;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// Seconds in a cap's window.
const WINDOW_S: u64 = 60;
/// Seconds counted: a request in second `s` counts until second `s + 60` is over, so two
/// requests it keeps apart are at least 60 s apart whatever their place in their seconds.
const SLOTS: usize = WINDOW_S as usize + 1;

/// The providers a request skipped for want of capacity: when it could make no attempt at
/// all, it is refused with 429 `capacity_exhausted` and a `Retry-After` of the soonest time a
/// skipped provider frees (instead of 502: no provider failed).
#[derive(Debug, Default)]
pub struct Skips {
    /// Whether one was skipped.
    any: bool,
    /// The soonest known time a skipped provider frees.
    soonest: Option<Millis>,
}

impl Skips {
    /// Notes a skip whose limit frees in `wait` (when known).
    pub fn note(&mut self, wait: Option<Millis>) {
        self.any = true;
        self.soonest = crate::upstream::limits::sooner(self.soonest, wait);
    }

    /// The refusal of a request that made `attempts` attempts, if it made none for want of
    /// capacity.
    #[must_use]
    pub fn refusal(&self, attempts: usize) -> Option<super::error::ApiError> {
        if !self.any || attempts > 0 {
            return None;
        }
        let wait = self.soonest;
        let mut e = super::error::ApiError::busy(
            "capacity_exhausted",
            "every provider this request can go to has used up its capacity (its declared \
             rpm, tpm or max_concurrency, or what its rate-limit headers said is left): \
             retry after the time in Retry-After",
        );
        let seconds = wait.map_or(1.0, |w| (w.0 / 1000.0).ceil().max(1.0));
        e.retry_after_s = Some(seconds.min(f64::from(u16::MAX)) as u16);
        Some(e)
    }
}

/// Sums per second over the seconds a cap's window can reach ([`SLOTS`]).
#[derive(Clone, Debug)]
struct Ring {
    /// Which second each slot counts (`second % SLOTS` is its slot).
    second: [u64; SLOTS],
    value: [u64; SLOTS],
}

impl Default for Ring {
    fn default() -> Ring {
        Ring {
            second: [0; SLOTS],
            value: [0; SLOTS],
        }
    }
}

impl Ring {
    fn live(&self, slot: usize, now_s: u64) -> bool {
        self.second[slot] + WINDOW_S >= now_s && self.value[slot] > 0
    }

    /// The sum over the window that ends with second `now_s`.
    fn sum(&self, now_s: u64) -> u64 {
        (0..self.value.len())
            .filter(|&i| self.live(i, now_s))
            .map(|i| self.value[i])
            .sum()
    }

    fn add(&mut self, now_s: u64, n: u64) {
        let slot = (now_s % SLOTS as u64) as usize;
        if self.second[slot] != now_s {
            self.second[slot] = now_s;
            self.value[slot] = 0;
        }
        self.value[slot] += n;
    }

    /// The wall-clock ms at which the oldest second still counted leaves the window.
    fn frees_at(&self, now_s: u64) -> Option<f64> {
        (0..self.value.len())
            .filter(|&i| self.live(i, now_s))
            .map(|i| self.second[i])
            .min()
            .map(|s| ((s + WINDOW_S + 1) * 1000) as f64)
    }
}

/// What the provider's headers last said is left, counted down since.
#[derive(Clone, Copy, Debug)]
struct Announced {
    remaining: u64,
    /// Wall-clock ms of the reset.
    until_ms: f64,
}

#[derive(Clone, Debug, Default)]
struct Counts {
    requests: Ring,
    tokens: Ring,
    announced: Option<Announced>,
}

/// One provider's capacity on one gateway instance.
#[derive(Debug)]
pub struct ProviderCapacity {
    pub caps: Caps,
    in_flight: AtomicU64,
    /// Whether its headers ever said what is left (the counts are read only then, or with a
    /// declared `rpm` or `tpm`).
    announces: AtomicBool,
    counts: Mutex<Counts>,
}

/// An attempt's place in its provider's capacity: counted in flight until dropped (with the
/// call's future, or with the stream it opened).
#[derive(Debug)]
pub struct Permit(Arc<ProviderCapacity>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether an attempt may go: a permit, or the limit that is used up and how long until it
/// frees (when known).
pub type Taken = Result<Permit, (Limit, Option<Millis>)>;

impl ProviderCapacity {
    #[must_use]
    pub fn new(caps: Caps) -> Arc<ProviderCapacity> {
        Arc::new(ProviderCapacity {
            caps,
            in_flight: AtomicU64::new(0),
            announces: AtomicBool::new(false),
            counts: Mutex::new(Counts::default()),
        })
    }

    /// A capacity with other caps and these counts (a reload that changed the caps).
    #[must_use]
    pub fn carried(&self, caps: Caps) -> Arc<ProviderCapacity> {
        let counts = self
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Arc::new(ProviderCapacity {
            caps,
            in_flight: AtomicU64::new(0),
            announces: AtomicBool::new(self.announces.load(Ordering::Relaxed)),
            counts: Mutex::new(counts),
        })
    }

    /// Requests in flight on this instance.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Whether taking a permit reads the counts (a declared `rpm` or `tpm`, or an announcing
    /// provider): else only requests in flight are counted.
    #[must_use]
    pub fn counted(&self) -> bool {
        self.caps.rpm.is_some() || self.caps.tpm.is_some() || self.announces.load(Ordering::Relaxed)
    }

    /// A place in flight, if `max_concurrency` allows one.
    ///
    /// # Errors
    /// As many requests in flight as `max_concurrency`.
    pub fn enter(self: &Arc<Self>) -> Taken {
        let max = self.caps.max_concurrency.unwrap_or(u64::MAX);
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .map(|_| Permit(self.clone()))
            .map_err(|_| (Limit::Concurrency, None))
    }

    /// Takes a request from this instance's counts at wall-clock `now_ms`: refused when the
    /// last 60 s hold `rpm` requests or `tpm` tokens, or the headers' count is down to 0
    /// before their reset. `shared`: the shared counts already admitted it (only recorded).
    ///
    /// # Errors
    /// The limit used up, and when it frees.
    pub fn take(&self, now_ms: f64, shared: bool) -> Result<(), (Limit, Option<Millis>)> {
        let now_s = (now_ms / 1000.0).max(0.0) as u64;
        let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let wait = |at: Option<f64>| at.map(|at| Millis((at - now_ms).max(0.0)));
        if !shared {
            if let Some(rpm) = self.caps.rpm {
                if c.requests.sum(now_s) >= rpm {
                    return Err((Limit::Requests, wait(c.requests.frees_at(now_s))));
                }
            }
            if let Some(tpm) = self.caps.tpm {
                if c.tokens.sum(now_s) >= tpm {
                    return Err((Limit::Tokens, wait(c.tokens.frees_at(now_s))));
                }
            }
        }
        match &mut c.announced {
            Some(a) if a.until_ms <= now_ms => c.announced = None,
            Some(a) if a.remaining == 0 && !shared => {
                return Err((Limit::Announced, wait(Some(a.until_ms))));
            }
            Some(a) => a.remaining = a.remaining.saturating_sub(1),
            None => {}
        }
        c.requests.add(now_s, 1);
        Ok(())
    }

    /// Counts the tokens an answer used (for `tpm`).
    pub fn spent(&self, now_ms: f64, tokens: u64) {
        if self.caps.tpm.is_some() && tokens > 0 {
            let now_s = (now_ms / 1000.0).max(0.0) as u64;
            let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
            c.tokens.add(now_s, tokens);
        }
    }

    /// What an answer's headers said is left of the requests until their reset, less the
    /// other requests still in flight (maybe not yet counted by the provider; the answering
    /// attempt holds its own permit while it is booked). The number from then on is counted
    /// down here. `None`: they said nothing (or no reset).
    pub fn announce(&self, now_ms: f64, capacity: &Capacity) -> Option<(u64, Millis)> {
        let left = capacity.requests?;
        let reset = left.reset.filter(|r| r.0 > 0.0)?;
        let others = self.in_flight().saturating_sub(1);
        let remaining = left.remaining.saturating_sub(others);
        self.announces.store(true, Ordering::Relaxed);
        let mut c = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        c.announced = Some(Announced {
            remaining,
            until_ms: now_ms + reset.0,
        });
        Some((remaining, reset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::limits::Left;

    fn caps(rpm: Option<u64>, tpm: Option<u64>, max_concurrency: Option<u64>) -> Caps {
        Caps {
            rpm,
            tpm,
            max_concurrency,
        }
    }

    #[test]
    fn rpm_admits_that_many_in_any_sixty_seconds_and_says_when_the_oldest_leaves() {
        let p = ProviderCapacity::new(caps(Some(3), None, None));
        let t0 = 1_000_000_500.0;
        assert!(p.take(t0, false).is_ok());
        assert!(p.take(t0 + 20_000.0, false).is_ok());
        assert!(p.take(t0 + 40_000.0, false).is_ok());
        // Three in the last 60 s: the fourth waits for the first second to leave.
        let (limit, wait) = p.take(t0 + 59_000.0, false).unwrap_err();
        assert_eq!(limit, Limit::Requests);
        // The first was counted in second 1_000_000 (it may have been sent at its last ms):
        // it leaves when second 1_000_060 is over.
        assert_eq!(wait, Some(Millis(1_000_061_000.0 - (t0 + 59_000.0))));
        assert!(p.take(t0 + 60_000.0, false).is_err());
        // A refusal is not counted: once the first leaves, one more goes.
        assert!(p.take(t0 + 60_500.0, false).is_ok());
        assert!(p.take(t0 + 60_600.0, false).is_err());
    }

    #[test]
    fn tpm_counts_the_tokens_answers_used() {
        let p = ProviderCapacity::new(caps(None, Some(1000), None));
        let t0 = 5_000_000.0;
        assert!(p.take(t0, false).is_ok());
        p.spent(t0, 600);
        assert!(p.take(t0 + 1.0, false).is_ok());
        p.spent(t0 + 1.0, 400);
        assert_eq!(p.take(t0 + 2.0, false).unwrap_err().0, Limit::Tokens);
        assert!(p.take(t0 + 61_000.0, false).is_ok());
    }

    #[test]
    fn a_request_that_skipped_every_provider_is_refused_with_the_soonest_wait() {
        let mut skips = Skips::default();
        assert!(skips.refusal(0).is_none());
        skips.note(Some(Millis(4200.0)));
        skips.note(None);
        skips.note(Some(Millis(1500.0)));
        let e = skips.refusal(0).unwrap();
        assert_eq!((e.status.as_u16(), e.code), (429, "capacity_exhausted"));
        assert_eq!(e.retry_after_s, Some(2));
        // A request that made an attempt failed on its own account.
        assert!(skips.refusal(1).is_none());
    }

    #[test]
    fn max_concurrency_holds_a_place_until_the_permit_is_dropped() {
        let p = ProviderCapacity::new(caps(None, None, Some(2)));
        let a = p.enter().unwrap();
        let b = p.enter().unwrap();
        assert_eq!(p.enter().unwrap_err().0, Limit::Concurrency);
        assert_eq!(p.in_flight(), 2);
        drop(a);
        let _c = p.enter().unwrap();
        drop(b);
        assert_eq!(p.in_flight(), 1);
        // Without the cap, any number, still counted.
        let q = ProviderCapacity::new(Caps::default());
        let permits: Vec<_> = (0..100).map(|_| q.enter().unwrap()).collect();
        assert_eq!(q.in_flight(), 100);
        drop(permits);
        assert_eq!(q.in_flight(), 0);
    }

    #[test]
    fn the_headers_count_is_counted_down_by_requests_sent_and_ends_at_its_reset() {
        let p = ProviderCapacity::new(Caps::default());
        assert!(!p.counted());
        let said = |remaining, reset_ms| Capacity {
            requests: Some(Left {
                remaining,
                reset: Some(Millis(reset_ms)),
            }),
            tokens: None,
        };
        // The answering attempt and one other in flight when the answer said 3 are left: 2
        // for the requests to come.
        let _answering = p.enter().unwrap();
        let _other = p.enter().unwrap();
        assert_eq!(
            p.announce(10_000.0, &said(3, 500.0)),
            Some((2, Millis(500.0)))
        );
        assert!(p.counted());
        assert!(p.take(10_001.0, false).is_ok());
        assert!(p.take(10_002.0, false).is_ok());
        let (limit, wait) = p.take(10_003.0, false).unwrap_err();
        assert_eq!((limit, wait), (Limit::Announced, Some(Millis(497.0))));
        // After the reset the count is no longer known: requests go (and the next answer
        // says again).
        assert!(p.take(10_500.0, false).is_ok());
        // Headers without a reset are not a count.
        assert_eq!(
            p.announce(
                11_000.0,
                &Capacity {
                    requests: Some(Left {
                        remaining: 0,
                        reset: None
                    }),
                    tokens: None
                }
            ),
            None
        );
    }
}
