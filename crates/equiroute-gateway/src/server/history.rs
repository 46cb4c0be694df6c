//! The recent traffic of one interface, kept for the dashboard: a [`History`] of fixed size,
//! allocated at start: a ring of [`BINS`] one-second bins of counts per provider, the last
//! [`DECISIONS`] decisions, the last [`FALLBACKS`] fallbacks, the last [`SHIFTS`] quality
//! shifts and the last [`MARKS`] changes marked on the operations view's time line (breakers
//! opening and closing, quality shifts); and the operations view's rings ([`super::ops`]),
//! counted under the same lock. The ledger (`super::book`) counts into it; the dashboard reads
//! it.

use super::audit::AuditRecord;
use super::ops::{self, KeyRow};
use equiroute_core::executor::{AttemptRecord, RequestResult, RequestStatus};
use equiroute_core::{AttemptStatus, Timestamp};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The width of one bin of the time series.
pub const BIN_MS: u64 = 1000;
/// Bins kept: five minutes.
pub const BINS: usize = 300;
/// Decisions kept in full, per interface.
pub const DECISIONS: usize = 20;
/// Fallbacks kept in full, per interface.
pub const FALLBACKS: usize = 20;
/// Quality shifts kept, per interface ([`super::shifts`]).
pub const SHIFTS: usize = 10;
/// Changes kept for the operations view's time line, per interface.
pub const MARKS: usize = 50;
/// After a poll of the data route, every request's decision is kept for this long; with nobody
/// watching only the counts (and the fallbacks) are, so an unwatched dashboard costs the
/// request path no allocation.
pub(super) const WATCHED_MS: f64 = 60_000.0;

/// One provider's counts in one bin.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Cell {
    /// Requests that ranked it first.
    pub(super) first: u32,
    pub(super) attempts: u32,
    /// Attempts that failed on the provider's side (errors, timeouts, and rejections another
    /// provider disputed by answering the request).
    pub(super) failures: u32,
    /// Attempts it answered.
    pub(super) answered: u32,
    /// Sum of the latencies of the answered attempts.
    pub(super) latency_ms: f64,
    /// Sum of what its attempts cost.
    pub(super) cost_usd: f64,
}

/// One bin's interface-wide counts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct Head {
    /// The bin's number (milliseconds since the Unix epoch / [`BIN_MS`]) plus one; 0: unused.
    pub(super) number: u64,
    pub(super) requests: u32,
    /// Requests that ended without an answer.
    pub(super) failed: u32,
    pub(super) deadline_missed: u32,
    /// Requests that moved on to another provider after an attempt failed.
    pub(super) fallbacks: u32,
    pub(super) cost_usd: f64,
}

#[derive(Debug)]
pub(super) struct Ring {
    pub(super) heads: Vec<Head>,
    /// `BINS × providers`, bin-major.
    pub(super) cells: Vec<Cell>,
    pub(super) providers: usize,
    pub(super) decisions: VecDeque<Value>,
    pub(super) fallbacks: VecDeque<Value>,
    pub(super) shifts: VecDeque<Value>,
    /// The operations view: five minutes at one second, 24 hours at one minute.
    pub(super) ops_seconds: ops::Bins,
    pub(super) ops_minutes: ops::Bins,
    pub(super) marks: VecDeque<Mark>,
}

/// A change marked on the operations view's time line.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Mark {
    pub ts_ms: f64,
    pub provider: String,
    /// `breaker_open`, `breaker_closed`, `quality_down` or `quality_up`.
    pub kind: &'static str,
}

impl Ring {
    /// The bin that holds `at`, cleared first when it last held an older second.
    pub(super) fn bin(&mut self, at: Timestamp) -> usize {
        let number = (at.0.max(0.0) as u64) / BIN_MS + 1;
        let slot = (number % BINS as u64) as usize;
        if self.heads[slot].number != number {
            self.heads[slot] = Head {
                number,
                ..Head::default()
            };
            let p = self.providers;
            self.cells[slot * p..(slot + 1) * p].fill(Cell::default());
        }
        slot
    }
}

/// An interface's recent traffic, for the dashboard (bounded: see the module doc).
#[derive(Debug)]
pub struct History {
    pub(super) ring: Mutex<Ring>,
    /// Until when (ms since the Unix epoch, as bits of an `f64`) decisions are kept in full.
    pub(super) watched_until: AtomicU64,
    /// The configured keys with a row in the operations view (at most [`ops::MAX_KEYS`]).
    pub(super) keys: Vec<KeyRow>,
    /// Tokens reported by each provider's attempts since the last request was counted
    /// (input, output): added without the lock, moved into the rings by [`History::count`].
    tokens: Vec<[AtomicU64; 2]>,
}

/// Whether a request moved to another provider after a failed attempt (a retry of the same
/// provider is not a fallback).
pub(super) fn fell_back(attempts: &[AttemptRecord]) -> bool {
    attempts.iter().skip(1).any(|a| a.retry.is_none())
}

impl History {
    /// An empty history for an interface of `providers` providers, with a row for each of
    /// `keys` (the first [`ops::MAX_KEYS`]).
    #[must_use]
    pub fn new(providers: usize, mut keys: Vec<KeyRow>) -> History {
        keys.truncate(ops::MAX_KEYS);
        let k = keys.len();
        History {
            ring: Mutex::new(Ring {
                heads: vec![Head::default(); BINS],
                cells: vec![Cell::default(); BINS * providers],
                providers,
                decisions: VecDeque::with_capacity(DECISIONS),
                fallbacks: VecDeque::with_capacity(FALLBACKS),
                shifts: VecDeque::with_capacity(SHIFTS),
                ops_seconds: ops::Bins::new(ops::SECOND_MS, ops::SECONDS, providers, k),
                ops_minutes: ops::Bins::new(ops::MINUTE_MS, ops::MINUTES, providers, k),
                marks: VecDeque::with_capacity(MARKS),
            }),
            watched_until: AtomicU64::new(0f64.to_bits()),
            keys,
            tokens: (0..providers).map(|_| Default::default()).collect(),
        }
    }

    /// Adds the tokens a provider reported for one attempt (counted into the rings with the
    /// next request, without a lock here).
    pub fn tokens(&self, candidate: usize, input: u64, output: u64) {
        if let Some([i, o]) = self.tokens.get(candidate) {
            i.fetch_add(input, Ordering::Relaxed);
            o.fetch_add(output, Ordering::Relaxed);
        }
    }

    /// Counts one finished request, ended at `at`, whose first choice was `first`, made with
    /// the key labelled `owner` (counted in its row when it has one).
    pub fn count(
        &self,
        at: Timestamp,
        first: Option<usize>,
        result: &RequestResult,
        (owner, content_filter): (Option<&str>, bool),
    ) {
        let (attempts, status) = (&result.attempts[..], result.status);
        let key = owner.and_then(|o| self.keys.iter().position(|k| *k.label == *o));
        let Ok(mut ring) = self.ring.lock() else {
            return;
        };
        let finished = ops::Finished {
            at,
            attempts,
            status,
            latency_ms: result.latency.0,
            key,
            content_filter,
        };
        ring.ops_seconds.count(&finished);
        ring.ops_minutes.count(&finished);
        for (i, [input, output]) in self.tokens.iter().enumerate() {
            // A load first: most requests find nothing to move, and a load is cheaper than a
            // swap.
            if input.load(Ordering::Relaxed) == 0 && output.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let (input, output) = (
                input.swap(0, Ordering::Relaxed),
                output.swap(0, Ordering::Relaxed),
            );
            if input + output > 0 {
                ring.ops_seconds.tokens(at, i, input, output);
                ring.ops_minutes.tokens(at, i, input, output);
            }
        }
        let slot = ring.bin(at);
        let p = ring.providers;
        let cost: f64 = attempts.iter().map(|a| a.outcome.cost.0).sum();
        let head = &mut ring.heads[slot];
        head.requests += 1;
        head.cost_usd += cost;
        head.failed += u32::from(!matches!(status, RequestStatus::Succeeded { .. }));
        head.deadline_missed += u32::from(status == RequestStatus::DeadlineExceeded);
        head.fallbacks += u32::from(fell_back(attempts));
        // A rejection by another provider than the one that answered was that provider's
        // (see `server::rejections`): a failure, not a 0 % failure rate for a provider
        // rejecting every request.
        let answerer = match status {
            RequestStatus::Succeeded { candidate } => Some(candidate),
            _ => None,
        };
        let cells = &mut ring.cells[slot * p..(slot + 1) * p];
        if let Some(c) = first.and_then(|f| cells.get_mut(f)) {
            c.first += 1;
        }
        for a in attempts {
            let Some(c) = cells.get_mut(a.candidate) else {
                continue;
            };
            c.attempts += 1;
            c.cost_usd += a.outcome.cost.0;
            match a.outcome.status {
                AttemptStatus::Ok => {
                    c.answered += 1;
                    c.latency_ms += a.outcome.latency.0;
                }
                AttemptStatus::ProviderError(_) | AttemptStatus::Timeout => c.failures += 1,
                AttemptStatus::ClientError => {
                    c.failures += u32::from(answerer.is_some_and(|b| b != a.candidate));
                }
                AttemptStatus::Cancelled => {}
            }
        }
    }

    /// Whether the request's full decision record is wanted: always for a fallback, else only
    /// while someone watches the dashboard.
    #[must_use]
    pub fn wants_record(&self, at: Timestamp, attempts: &[AttemptRecord]) -> bool {
        fell_back(attempts) || at.0 < f64::from_bits(self.watched_until.load(Ordering::Relaxed))
    }

    /// Keeps a request's decision record (and, for a fallback, in the fallbacks too).
    pub fn keep(&self, record: &AuditRecord, attempts: &[AttemptRecord]) {
        let Ok(value) = serde_json::to_value(record) else {
            return;
        };
        let Ok(mut ring) = self.ring.lock() else {
            return;
        };
        if fell_back(attempts) {
            if ring.fallbacks.len() == FALLBACKS {
                ring.fallbacks.pop_front();
            }
            ring.fallbacks.push_back(value.clone());
        }
        if ring.decisions.len() == DECISIONS {
            ring.decisions.pop_front();
        }
        ring.decisions.push_back(value);
    }

    /// Keeps a detected quality shift (the last [`SHIFTS`]).
    pub fn shift(&self, record: &super::shifts::ShiftRecord) {
        let Ok(value) = serde_json::to_value(record) else {
            return;
        };
        let Ok(mut ring) = self.ring.lock() else {
            return;
        };
        if ring.shifts.len() == SHIFTS {
            ring.shifts.pop_front();
        }
        ring.shifts.push_back(value);
    }

    /// Counts a quality score of `candidate`'s answer, received at `at`.
    pub fn score(&self, at: Timestamp, candidate: usize, quality: f64) {
        let Ok(mut ring) = self.ring.lock() else {
            return;
        };
        ring.ops_seconds.score(at, candidate, quality);
        ring.ops_minutes.score(at, candidate, quality);
    }

    /// Marks a change on the operations view's time line (the last [`MARKS`]).
    pub fn mark(&self, mark: Mark) {
        let Ok(mut ring) = self.ring.lock() else {
            return;
        };
        if ring.marks.len() == MARKS {
            ring.marks.pop_front();
        }
        ring.marks.push_back(mark);
    }

    /// The operations view up to `now` (see [`super::ops`]): the ring of `horizon_ms`
    /// (at most five minutes: the one-second ring, else the one-minute ring) cut to the
    /// horizon, the totals of the last hour and day, and the marks in the horizon. A bin
    /// before `since_ms` with nothing counted is no data, not zero.
    pub(super) fn operations(
        &self,
        now: Timestamp,
        since_ms: f64,
        horizon_ms: u64,
        ids: &[String],
    ) -> Value {
        let seconds = horizon_ms <= ops::SECOND_MS * ops::SECONDS as u64;
        let width = if seconds {
            ops::SECOND_MS
        } else {
            ops::MINUTE_MS
        };
        let from = now.0 - horizon_ms as f64;
        let hour = (3_600_000 / ops::MINUTE_MS) as usize;
        // Under the lock only a copy of the ring (about 1 MB at most) and the small totals:
        // the series are built after, so the request path never waits for them.
        let (bins, marks, last_hour, last_day) = {
            let Ok(ring) = self.ring.lock() else {
                return Value::Null;
            };
            let bins = if seconds {
                ring.ops_seconds.clone()
            } else {
                ring.ops_minutes.clone()
            };
            let marks: Vec<Mark> = ring
                .marks
                .iter()
                .filter(|m| m.ts_ms >= from)
                .cloned()
                .collect();
            let last_hour = ring.ops_minutes.totals(now, hour, ids, &self.keys);
            let last_day = ring.ops_minutes.totals(now, ops::MINUTES, ids, &self.keys);
            (bins, marks, last_hour, last_day)
        };
        let span = (horizon_ms / width).max(1) as usize;
        let mut view = bins.view(now, since_ms, ids, &self.keys, span);
        view["marks"] = json!(marks);
        view["last_hour"] = last_hour;
        view["last_day"] = last_day;
        view
    }

    /// The minute ring, for the state file.
    pub(crate) fn save_minutes(
        &self,
        now: Timestamp,
        ids: &[String],
    ) -> Option<ops::SavedInterface> {
        let ring = self.ring.lock().ok()?;
        Some(ring.ops_minutes.save(now, ids, &self.keys))
    }

    /// Takes a saved minute ring (see [`ops::Bins::restore`]); returns the bins taken.
    pub(crate) fn restore_minutes(&self, saved: &ops::SavedInterface, ids: &[String]) -> usize {
        self.ring.lock().map_or(0, |mut ring| {
            ring.ops_minutes.restore(saved, ids, &self.keys)
        })
    }

    /// Marks the dashboard as watched at `now`.
    pub(super) fn watch(&self, now: Timestamp) {
        self.watched_until
            .store((now.0 + WATCHED_MS).to_bits(), Ordering::Relaxed);
    }

    /// The last [`BINS`] seconds up to `now`, oldest first, with the kept decisions,
    /// fallbacks and quality shifts, newest first.
    pub(super) fn view(&self, now: Timestamp, ids: &[String]) -> Value {
        let Ok(ring) = self.ring.lock() else {
            return Value::Null;
        };
        let last = (now.0.max(0.0) as u64) / BIN_MS + 1;
        let p = ring.providers;
        let mut heads = Vec::with_capacity(BINS);
        let mut cells = vec![Vec::with_capacity(BINS); p];
        for number in (last + 1).saturating_sub(BINS as u64)..=last {
            let slot = (number % BINS as u64) as usize;
            let live = ring.heads[slot].number == number;
            heads.push(if live {
                ring.heads[slot]
            } else {
                Head::default()
            });
            for (i, col) in cells.iter_mut().enumerate() {
                col.push(if live {
                    ring.cells[slot * p + i]
                } else {
                    Cell::default()
                });
            }
        }
        let column = |f: &dyn Fn(&Head) -> Value| heads.iter().map(f).collect::<Vec<_>>();
        let providers: serde_json::Map<String, Value> = ids
            .iter()
            .zip(&cells)
            .map(|(id, col)| {
                let of = |f: &dyn Fn(&Cell) -> Value| col.iter().map(f).collect::<Vec<_>>();
                (
                    id.clone(),
                    json!({
                        "first": of(&|c| c.first.into()),
                        "attempts": of(&|c| c.attempts.into()),
                        "failures": of(&|c| c.failures.into()),
                        "answered": of(&|c| c.answered.into()),
                        "latency_ms_sum": of(&|c| c.latency_ms.into()),
                        "cost_usd": of(&|c| c.cost_usd.into()),
                    }),
                )
            })
            .collect();
        json!({
            "series": {
                "bin_ms": BIN_MS,
                "end_ms": (last * BIN_MS) as f64,
                "requests": column(&|h| h.requests.into()),
                "failed": column(&|h| h.failed.into()),
                "deadline_missed": column(&|h| h.deadline_missed.into()),
                "fallbacks": column(&|h| h.fallbacks.into()),
                "cost_usd": column(&|h| h.cost_usd.into()),
                "providers": providers,
            },
            "decisions": ring.decisions.iter().rev().collect::<Vec<_>>(),
            "fallbacks": ring.fallbacks.iter().rev().collect::<Vec<_>>(),
            "shifts": ring.shifts.iter().rev().collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use equiroute_core::executor::RetryReason;
    use equiroute_core::{AttemptOutcome, Millis, ProviderFailure, Usd};

    fn attempt(
        candidate: usize,
        status: AttemptStatus,
        retry: Option<RetryReason>,
    ) -> AttemptRecord {
        AttemptRecord {
            candidate,
            started: Timestamp(0.0),
            outcome: AttemptOutcome {
                latency: Millis(100.0),
                status,
                cost: Usd(0.5),
                time_to_first_byte: None,
                retry_after: None,
            },
            retry,
            hedge: false,
        }
    }

    fn done(attempts: Vec<AttemptRecord>, status: RequestStatus) -> RequestResult {
        RequestResult {
            status,
            attempts,
            latency: Millis(100.0),
            cost: Usd(0.0),
        }
    }

    #[test]
    fn a_fallback_is_counted_in_its_second_and_old_seconds_fall_out_of_the_ring() {
        let h = History::new(2, Vec::new());
        let failed = AttemptStatus::ProviderError(ProviderFailure::Server);
        let t = Timestamp(1_000_000.0);
        // a fails, b answers: a fallback, first choice a.
        h.count(
            t,
            Some(0),
            &done(
                vec![
                    attempt(0, failed, None),
                    attempt(1, AttemptStatus::Ok, None),
                ],
                RequestStatus::Succeeded { candidate: 1 },
            ),
            (None, false),
        );
        // a retried once on itself: not a fallback.
        h.count(
            Timestamp(t.0 + 500.0),
            Some(0),
            &done(
                vec![
                    attempt(0, failed, None),
                    attempt(0, AttemptStatus::Ok, Some(RetryReason::ServerError)),
                ],
                RequestStatus::Succeeded { candidate: 0 },
            ),
            (None, false),
        );
        let ids = ["a".to_owned(), "b".to_owned()];
        let v = h.view(Timestamp(t.0 + 900.0), &ids);
        let s = &v["series"];
        assert_eq!(s["requests"].as_array().unwrap().len(), BINS);
        assert_eq!(s["requests"][BINS - 1], 2);
        assert_eq!(s["fallbacks"][BINS - 1], 1);
        assert_eq!(s["cost_usd"][BINS - 1], 2.0, "four attempts at $0.5");
        assert_eq!(s["providers"]["a"]["first"][BINS - 1], 2);
        assert_eq!(s["providers"]["a"]["attempts"][BINS - 1], 3);
        assert_eq!(s["providers"]["a"]["failures"][BINS - 1], 2);
        assert_eq!(s["providers"]["b"]["answered"][BINS - 1], 1);
        // b rejects what a answers: b's failure; both reject: the request's, no one's.
        let rejected = AttemptStatus::ClientError;
        h.count(
            Timestamp(t.0 + 600.0),
            Some(1),
            &done(
                vec![
                    attempt(1, rejected, None),
                    attempt(0, AttemptStatus::Ok, None),
                ],
                RequestStatus::Succeeded { candidate: 0 },
            ),
            (None, false),
        );
        h.count(
            Timestamp(t.0 + 700.0),
            Some(1),
            &done(
                vec![attempt(1, rejected, None), attempt(0, rejected, None)],
                RequestStatus::ClientError { candidate: 0 },
            ),
            (None, false),
        );
        let v = h.view(Timestamp(t.0 + 900.0), &ids);
        assert_eq!(v["series"]["providers"]["b"]["failures"][BINS - 1], 1);
        assert_eq!(v["series"]["providers"]["a"]["failures"][BINS - 1], 2);
        // One second later the counts are one bin back; BINS seconds later they are gone.
        let later = h.view(Timestamp(t.0 + 1000.0), &ids);
        assert_eq!(later["series"]["requests"][BINS - 2], 4);
        assert_eq!(later["series"]["requests"][BINS - 1], 0);
        let gone = h.view(Timestamp(t.0 + 1000.0 * BINS as f64), &ids);
        assert!(gone["series"]["requests"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r == 0));
        // A request in a reused slot does not inherit the old second's counts.
        h.count(
            Timestamp(t.0 + 1000.0 * BINS as f64),
            Some(1),
            &done(
                vec![attempt(1, AttemptStatus::Ok, None)],
                RequestStatus::Succeeded { candidate: 1 },
            ),
            (None, false),
        );
        let reused = h.view(Timestamp(t.0 + 1000.0 * BINS as f64), &ids);
        assert_eq!(reused["series"]["requests"][BINS - 1], 1);
        assert_eq!(reused["series"]["providers"]["a"]["first"][BINS - 1], 0);
    }

    #[test]
    fn decisions_are_kept_only_while_watched_and_fallbacks_always_both_bounded() {
        let h = History::new(2, Vec::new());
        let t = Timestamp(5_000.0);
        let ok = [attempt(0, AttemptStatus::Ok, None)];
        let fallback = [
            attempt(0, AttemptStatus::Timeout, None),
            attempt(1, AttemptStatus::Ok, None),
        ];
        assert!(!h.wants_record(t, &ok), "nobody watches");
        assert!(h.wants_record(t, &fallback));
        h.watch(t);
        assert!(h.wants_record(Timestamp(t.0 + WATCHED_MS - 1.0), &ok));
        assert!(!h.wants_record(Timestamp(t.0 + WATCHED_MS + 1.0), &ok));
        let record = |id: usize| AuditRecord {
            ts_ms: t.0,
            request_id: format!("req-{id}"),
            interface: "chat".into(),
            policy: "lqm-ts",
            candidates: vec!["a".into(), "b".into()],
            excluded: vec![],
            scores: vec![],
            order: vec!["a".into(), "b".into()],
            propensity: None,
            last_resort: false,
            attempts: vec![],
            outcome: "ok".into(),
            fallback_reason: None,
            latency_ms: 1.0,
            cost_usd: 0.0,
            ..AuditRecord::default()
        };
        for i in 0..DECISIONS + 5 {
            h.keep(&record(i), if i % 2 == 0 { &fallback } else { &ok });
        }
        let v = h.view(t, &["a".to_owned(), "b".to_owned()]);
        let decisions = v["decisions"].as_array().unwrap();
        assert_eq!(decisions.len(), DECISIONS);
        assert_eq!(
            decisions[0]["request_id"],
            format!("req-{}", DECISIONS + 4),
            "newest first"
        );
        let fallbacks = v["fallbacks"].as_array().unwrap();
        assert_eq!(fallbacks.len(), (DECISIONS + 5).div_ceil(2).min(FALLBACKS));
        assert_eq!(fallbacks[0]["request_id"], format!("req-{}", DECISIONS + 4));
    }
}
