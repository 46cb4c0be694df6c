//! The operations view's counts (the dashboard's "Operations" section): per interface, two
//! rings of fixed size allocated at start, [`SECONDS`] one-second bins (5 minutes) and
//! [`MINUTES`] one-minute bins (24 hours), each bin holding per provider the attempts, the
//! answers, the errors by [`ErrorClass`], a latency histogram ([`Latencies`], from which
//! p50/p95/p99 are read), the cost, the tokens and the quality scores received; end to end the
//! requests, failures, a latency histogram and the cost; and per configured key (the first
//! [`MAX_KEYS`]) the requests, failures and cost. An unknown or absent key counts in no key's
//! row, so nothing a client sends creates a series.
//!
//! Counting is done under the lock the history already takes for a request
//! ([`super::history::History::count`]), without allocating. The minute ring is saved in the
//! state file beside the learning snapshot ([`Saved`], versioned: a missing, older or
//! unreadable record starts the ring empty, it never refuses the file; see
//! [`super::minutes`]).

use equiroute_core::executor::{AttemptRecord, RequestStatus};
use equiroute_core::{AttemptStatus, ProviderFailure, Timestamp};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// The width of a bin of the short ring.
pub const SECOND_MS: u64 = 1000;
/// Bins of the short ring: five minutes.
pub const SECONDS: usize = 300;
/// The width of a bin of the long ring.
pub const MINUTE_MS: u64 = 60_000;
/// Bins of the long ring: 24 hours.
pub const MINUTES: usize = 1440;
/// Buckets of a latency histogram: bucket 0 holds up to 1 ms, buckets 1 to
/// `LATENCY_BUCKETS - 2` are log-spaced up to [`LATENCY_MAX_MS`], the last holds the rest.
pub const LATENCY_BUCKETS: usize = 32;
/// The top of the histogram's log-spaced buckets: 120 s.
pub const LATENCY_MAX_MS: f64 = 120_000.0;
/// Keys with a row of their own (the first configured, in configuration order).
pub const MAX_KEYS: usize = 64;
/// Version of the saved minute ring ([`Saved`]).
pub const SAVED_VERSION: u32 = 2;

/// Why an attempt failed, as the operations view counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// HTTP 429 or a quota error.
    RateLimited,
    /// HTTP 5xx (and 401/403/404, a configuration fault on the provider's side).
    Server,
    Timeout,
    /// Refused, reset, TLS or DNS.
    Connection,
    /// A 4xx rejection of the request.
    Client,
    /// A stream that broke after it started.
    StreamBroken,
    /// The provider's content filter refused the request (the refusal that ended it).
    ContentFilter,
}

/// The classes, in the order of [`Cell::errors`].
pub const ERROR_CLASSES: [ErrorClass; 7] = [
    ErrorClass::RateLimited,
    ErrorClass::Server,
    ErrorClass::Timeout,
    ErrorClass::Connection,
    ErrorClass::Client,
    ErrorClass::StreamBroken,
    ErrorClass::ContentFilter,
];

impl ErrorClass {
    /// The class of an attempt's status; `None` for an answer or a cancellation.
    #[must_use]
    pub fn of(status: AttemptStatus) -> Option<ErrorClass> {
        match status {
            AttemptStatus::Ok | AttemptStatus::Cancelled => None,
            AttemptStatus::ClientError => Some(ErrorClass::Client),
            AttemptStatus::Timeout => Some(ErrorClass::Timeout),
            AttemptStatus::ProviderError(f) => Some(match f {
                ProviderFailure::RateLimited => ErrorClass::RateLimited,
                ProviderFailure::Server => ErrorClass::Server,
                ProviderFailure::Connection => ErrorClass::Connection,
                ProviderFailure::StreamBroken => ErrorClass::StreamBroken,
            }),
        }
    }

    /// Its name in the JSON and on the page.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ErrorClass::RateLimited => "429",
            ErrorClass::Server => "5xx",
            ErrorClass::Timeout => "timeout",
            ErrorClass::Connection => "connection",
            ErrorClass::Client => "4xx",
            ErrorClass::StreamBroken => "stream_broken",
            ErrorClass::ContentFilter => "content_filter",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A latency histogram of fixed log-spaced buckets (see [`LATENCY_BUCKETS`]): a quantile read
/// from it is within one bucket's width (a factor of about 1.48) of the true one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Latencies(pub [u32; LATENCY_BUCKETS]);

impl Default for Latencies {
    fn default() -> Latencies {
        Latencies([0; LATENCY_BUCKETS])
    }
}

/// The upper bound of bucket `i` in milliseconds (the last bucket has none: infinity).
fn upper_ms(i: usize) -> f64 {
    let top = (LATENCY_BUCKETS - 2) as f64;
    if i + 1 >= LATENCY_BUCKETS {
        f64::INFINITY
    } else {
        LATENCY_MAX_MS.powf(i as f64 / top)
    }
}

impl Latencies {
    /// The bucket of a latency of `ms`.
    #[must_use]
    pub fn bucket(ms: f64) -> usize {
        if ms.is_nan() || ms <= 1.0 {
            return 0;
        }
        let top = (LATENCY_BUCKETS - 2) as f64;
        let i = (ms.ln() / LATENCY_MAX_MS.ln() * top).ceil();
        (i as usize).min(LATENCY_BUCKETS - 1)
    }

    pub fn add(&mut self, ms: f64) {
        let b = Latencies::bucket(ms);
        self.0[b] = self.0[b].saturating_add(1);
    }

    pub fn merge(&mut self, other: &Latencies) {
        for (a, b) in self.0.iter_mut().zip(other.0) {
            *a = a.saturating_add(b);
        }
    }

    #[must_use]
    pub fn count(&self) -> u64 {
        self.0.iter().map(|&c| u64::from(c)).sum()
    }

    /// The `q` quantile (0 < q ≤ 1), interpolated log-linearly inside its bucket; `None`
    /// without a sample. The last bucket reads as [`LATENCY_MAX_MS`].
    #[must_use]
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = (q * n as f64).ceil().max(1.0);
        let mut below = 0.0;
        for (i, &c) in self.0.iter().enumerate() {
            let c = f64::from(c);
            if c > 0.0 && below + c >= rank {
                if i == 0 {
                    return Some(1.0);
                }
                if i + 1 == LATENCY_BUCKETS {
                    return Some(LATENCY_MAX_MS);
                }
                let (lo, hi) = (upper_ms(i - 1), upper_ms(i));
                let frac = (rank - below) / c;
                return Some(lo * (hi / lo).powf(frac));
            }
            below += c;
        }
        Some(LATENCY_MAX_MS)
    }
}

/// One provider's counts in one bin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    pub attempts: u32,
    pub answered: u32,
    /// By [`ERROR_CLASSES`].
    pub errors: [u32; ERROR_CLASSES.len()],
    /// Of the answered attempts.
    pub latency: Latencies,
    pub cost_usd: f64,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub quality_sum: f64,
    pub quality_n: u32,
}

/// One bin's end-to-end counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Head {
    /// The bin's number (ms since the Unix epoch / the bin's width) plus one; 0: unused.
    pub number: u64,
    pub requests: u32,
    /// Requests that ended without an answer.
    pub failed: u32,
    pub latency: Latencies,
    pub cost_usd: f64,
}

/// One key's counts in one bin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KeyCell {
    pub requests: u32,
    pub failed: u32,
    pub cost_usd: f64,
}

/// A ring of `len` bins of `bin_ms` each (see the module doc).
#[derive(Clone, Debug)]
pub struct Bins {
    bin_ms: u64,
    len: usize,
    providers: usize,
    keys: usize,
    heads: Vec<Head>,
    /// `len × providers`, bin-major.
    cells: Vec<Cell>,
    /// `len × keys`, bin-major.
    key_cells: Vec<KeyCell>,
}

/// A finished request as the operations view counts it.
#[derive(Clone, Copy)]
pub struct Finished<'a> {
    pub at: Timestamp,
    pub attempts: &'a [AttemptRecord],
    pub status: RequestStatus,
    /// From the request's start to its end.
    pub latency_ms: f64,
    /// The index of the key that made it, if it has a row.
    pub key: Option<usize>,
    /// It ended on a content filter's refusal (its last attempt's).
    pub content_filter: bool,
}

impl Bins {
    #[must_use]
    pub fn new(bin_ms: u64, len: usize, providers: usize, keys: usize) -> Bins {
        Bins {
            bin_ms,
            len,
            providers,
            keys,
            heads: vec![Head::default(); len],
            cells: vec![Cell::default(); len * providers],
            key_cells: vec![KeyCell::default(); len * keys],
        }
    }

    fn number(&self, at_ms: f64) -> u64 {
        (at_ms.max(0.0) as u64) / self.bin_ms + 1
    }

    /// The slot of bin `number`, cleared first when it last held an older bin.
    fn slot_of(&mut self, number: u64) -> usize {
        let slot = (number % self.len as u64) as usize;
        if self.heads[slot].number != number {
            self.heads[slot] = Head {
                number,
                ..Head::default()
            };
            let (p, k) = (self.providers, self.keys);
            self.cells[slot * p..(slot + 1) * p].fill(Cell::default());
            self.key_cells[slot * k..(slot + 1) * k].fill(KeyCell::default());
        }
        slot
    }

    /// Counts a finished request (every attempt in its provider's cell).
    pub fn count(&mut self, r: &Finished<'_>) {
        let slot = self.slot_of(self.number(r.at.0));
        let cost: f64 = r.attempts.iter().map(|a| a.outcome.cost.0).sum();
        let failed = !matches!(r.status, RequestStatus::Succeeded { .. });
        let head = &mut self.heads[slot];
        head.requests += 1;
        head.failed += u32::from(failed);
        head.latency.add(r.latency_ms);
        head.cost_usd += cost;
        let p = self.providers;
        for (i, a) in r.attempts.iter().enumerate() {
            let refused = r.content_filter && i + 1 == r.attempts.len();
            let Some(c) = self.cells[slot * p..(slot + 1) * p].get_mut(a.candidate) else {
                continue;
            };
            c.attempts += 1;
            c.cost_usd += a.outcome.cost.0;
            if a.outcome.status == AttemptStatus::Ok {
                c.answered += 1;
                c.latency.add(a.outcome.latency.0);
            }
            let class = match ErrorClass::of(a.outcome.status) {
                Some(ErrorClass::Client) if refused => Some(ErrorClass::ContentFilter),
                class => class,
            };
            if let Some(class) = class {
                c.errors[class.index()] += 1;
            }
        }
        if let Some(k) = r.key.filter(|&k| k < self.keys) {
            let cell = &mut self.key_cells[slot * self.keys + k];
            cell.requests += 1;
            cell.failed += u32::from(failed);
            cell.cost_usd += cost;
        }
    }

    /// Adds tokens reported by `candidate`'s attempts to the bin of `at`.
    pub fn tokens(&mut self, at: Timestamp, candidate: usize, input: u64, output: u64) {
        let slot = self.slot_of(self.number(at.0));
        if let Some(c) = self.cells.get_mut(slot * self.providers + candidate) {
            c.tokens_in += input;
            c.tokens_out += output;
        }
    }

    /// Adds a quality score of `candidate`'s answer to the bin of `at`.
    pub fn score(&mut self, at: Timestamp, candidate: usize, quality: f64) {
        if candidate >= self.providers || !quality.is_finite() {
            return;
        }
        let slot = self.slot_of(self.number(at.0));
        let c = &mut self.cells[slot * self.providers + candidate];
        c.quality_sum += quality;
        c.quality_n += 1;
    }

    /// The live slot of bin `number`, if the ring holds it.
    fn live(&self, number: u64) -> Option<usize> {
        let slot = (number % self.len as u64) as usize;
        (self.heads[slot].number == number).then_some(slot)
    }

    /// The bin numbers of the last `span` bins up to `now`, oldest first.
    fn window(&self, now: Timestamp, span: usize) -> std::ops::RangeInclusive<u64> {
        let last = self.number(now.0);
        (last + 1).saturating_sub(span.min(self.len) as u64)..=last
    }

    /// The last `span` bins' series up to `now`, oldest first: a bin with nothing counted is 0 from
    /// `since_ms` (the gateway's start) on and `null` before it (no data, not no traffic);
    /// rates and quantiles are `null` where nothing was seen. Per provider, per key, and the
    /// horizon's totals.
    #[must_use]
    pub fn view(
        &self,
        now: Timestamp,
        since_ms: f64,
        ids: &[String],
        keys: &[KeyRow],
        span: usize,
    ) -> Value {
        let numbers = self.window(now, span);
        let p = self.providers;
        let bins: Vec<Option<usize>> = numbers.clone().map(|n| self.live(n)).collect();
        let known: Vec<bool> = numbers
            .clone()
            .zip(&bins)
            .map(|(n, s)| s.is_some() || (n * self.bin_ms) as f64 > since_ms)
            .collect();
        // One series: `f` of the live slot, 0 for a known empty bin, null before.
        let series = |f: &dyn Fn(usize) -> Value, empty: Value| -> Vec<Value> {
            bins.iter()
                .zip(&known)
                .map(|(s, k)| match (s, k) {
                    (Some(s), _) => f(*s),
                    (None, true) => empty.clone(),
                    (None, false) => Value::Null,
                })
                .collect()
        };
        let q = |l: &Latencies, at: f64| l.quantile(at).map_or(Value::Null, |v| json!(round(v)));
        let mut providers = Map::new();
        for (i, id) in ids.iter().enumerate().take(p) {
            let cell = |s: usize| &self.cells[s * p + i];
            let mut errors = Map::new();
            for class in ERROR_CLASSES {
                errors.insert(
                    class.name().into(),
                    json!(series(&|s| cell(s).errors[class.index()].into(), json!(0))),
                );
            }
            let mut total = Cell::default();
            for s in bins.iter().flatten() {
                add_cell(&mut total, cell(*s));
            }
            providers.insert(
                id.clone(),
                json!({
                    "attempts": series(&|s| cell(s).attempts.into(), json!(0)),
                    "answered": series(&|s| cell(s).answered.into(), json!(0)),
                    "errors": errors,
                    "p50": series(&|s| q(&cell(s).latency, 0.5), Value::Null),
                    "p95": series(&|s| q(&cell(s).latency, 0.95), Value::Null),
                    "p99": series(&|s| q(&cell(s).latency, 0.99), Value::Null),
                    "cost_usd": series(&|s| cell(s).cost_usd.into(), json!(0)),
                    "quality": series(&|s| {
                        let c = cell(s);
                        if c.quality_n == 0 { Value::Null } else { json!(c.quality_sum / f64::from(c.quality_n)) }
                    }, Value::Null),
                    "total": cell_totals(&total),
                }),
            );
        }
        let mut all = Head::default();
        for s in bins.iter().flatten() {
            add_head(&mut all, &self.heads[*s]);
        }
        json!({
            "bin_ms": self.bin_ms,
            "end_ms": (numbers.end() * self.bin_ms) as f64,
            "requests": series(&|s| self.heads[s].requests.into(), json!(0)),
            "failed": series(&|s| self.heads[s].failed.into(), json!(0)),
            "p50": series(&|s| q(&self.heads[s].latency, 0.5), Value::Null),
            "p95": series(&|s| q(&self.heads[s].latency, 0.95), Value::Null),
            "p99": series(&|s| q(&self.heads[s].latency, 0.99), Value::Null),
            "cost_usd": series(&|s| self.heads[s].cost_usd.into(), json!(0)),
            "total": head_totals(&all),
            "providers": providers,
            "keys": self.key_totals(now, span, keys),
        })
    }

    /// Totals of the last `span` bins up to `now`: end to end, per provider (cost, tokens,
    /// attempts, errors) and per key.
    #[must_use]
    pub fn totals(&self, now: Timestamp, span: usize, ids: &[String], keys: &[KeyRow]) -> Value {
        let p = self.providers;
        let slots: Vec<usize> = self
            .window(now, span)
            .filter_map(|n| self.live(n))
            .collect();
        let mut all = Head::default();
        for &s in &slots {
            add_head(&mut all, &self.heads[s]);
        }
        let providers: Map<String, Value> = ids
            .iter()
            .enumerate()
            .take(p)
            .map(|(i, id)| {
                let mut total = Cell::default();
                for &s in &slots {
                    add_cell(&mut total, &self.cells[s * p + i]);
                }
                (id.clone(), cell_totals(&total))
            })
            .collect();
        json!({
            "total": head_totals(&all),
            "providers": providers,
            "keys": self.key_totals(now, span, keys),
        })
    }

    fn key_totals(&self, now: Timestamp, span: usize, keys: &[KeyRow]) -> Vec<Value> {
        let slots: Vec<usize> = self
            .window(now, span)
            .filter_map(|n| self.live(n))
            .collect();
        keys.iter()
            .enumerate()
            .take(self.keys)
            .map(|(k, row)| {
                let mut t = KeyCell::default();
                for &s in &slots {
                    let c = &self.key_cells[s * self.keys + k];
                    t.requests += c.requests;
                    t.failed += c.failed;
                    t.cost_usd += c.cost_usd;
                }
                json!({"key": &*row.label, "tenant": row.tenant, "requests": t.requests, "failed": t.failed, "cost_usd": t.cost_usd})
            })
            .collect()
    }

    /// The live bins of the last 24 hours up to `now`, for the state file.
    #[must_use]
    pub fn save(&self, now: Timestamp, ids: &[String], keys: &[KeyRow]) -> SavedInterface {
        let (p, k) = (self.providers, self.keys);
        let bins = self
            .window(now, self.len)
            .filter_map(|n| self.live(n))
            .map(|s| SavedBin {
                head: self.heads[s],
                cells: self.cells[s * p..(s + 1) * p].to_vec(),
                keys: self.key_cells[s * k..(s + 1) * k].to_vec(),
            })
            .collect();
        SavedInterface {
            bin_ms: self.bin_ms,
            providers: ids.to_vec(),
            keys: keys.iter().map(|r| r.label.to_string()).collect(),
            bins,
        }
    }

    /// Takes the bins of `saved` (of the same providers, in the same order, and the same bin
    /// width; else nothing); keys are matched by label. Returns the bins taken.
    pub fn restore(&mut self, saved: &SavedInterface, ids: &[String], keys: &[KeyRow]) -> usize {
        if saved.bin_ms != self.bin_ms || saved.providers != ids {
            return 0;
        }
        let key_map: Vec<Option<usize>> = saved
            .keys
            .iter()
            .map(|l| keys.iter().position(|r| *r.label == **l))
            .collect();
        let mut taken = 0;
        for bin in &saved.bins {
            if bin.head.number == 0 || bin.cells.len() != self.providers {
                continue;
            }
            let slot = self.slot_of(bin.head.number);
            self.heads[slot] = bin.head;
            let p = self.providers;
            self.cells[slot * p..(slot + 1) * p].copy_from_slice(&bin.cells);
            for (from, cell) in bin.keys.iter().enumerate() {
                if let Some(Some(k)) = key_map.get(from) {
                    if *k < self.keys {
                        self.key_cells[slot * self.keys + k] = *cell;
                    }
                }
            }
            taken += 1;
        }
        taken
    }
}

/// A configured key with a row of its own: its label and the tenant it is bound to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRow {
    pub label: Arc<str>,
    pub tenant: Option<String>,
}

fn add_cell(t: &mut Cell, c: &Cell) {
    t.attempts += c.attempts;
    t.answered += c.answered;
    for (a, b) in t.errors.iter_mut().zip(c.errors) {
        *a += b;
    }
    t.latency.merge(&c.latency);
    t.cost_usd += c.cost_usd;
    t.tokens_in += c.tokens_in;
    t.tokens_out += c.tokens_out;
    t.quality_sum += c.quality_sum;
    t.quality_n += c.quality_n;
}

fn add_head(t: &mut Head, h: &Head) {
    t.requests += h.requests;
    t.failed += h.failed;
    t.latency.merge(&h.latency);
    t.cost_usd += h.cost_usd;
}

/// Milliseconds to 0.1 ms.
fn round(ms: f64) -> f64 {
    (ms * 10.0).round() / 10.0
}

fn quantiles(l: &Latencies) -> Value {
    let q = |q: f64| l.quantile(q).map(round);
    json!({"p50": q(0.5), "p95": q(0.95), "p99": q(0.99)})
}

fn cell_totals(c: &Cell) -> Value {
    let errors: Map<String, Value> = ERROR_CLASSES
        .iter()
        .map(|e| (e.name().to_owned(), json!(c.errors[e.index()])))
        .collect();
    json!({
        "attempts": c.attempts,
        "answered": c.answered,
        "errors": errors,
        "latency_ms": quantiles(&c.latency),
        "cost_usd": c.cost_usd,
        "tokens_in": c.tokens_in,
        "tokens_out": c.tokens_out,
        "quality": (c.quality_n > 0).then(|| c.quality_sum / f64::from(c.quality_n)),
        "scores": c.quality_n,
    })
}

fn head_totals(h: &Head) -> Value {
    json!({
        "requests": h.requests,
        "failed": h.failed,
        "latency_ms": quantiles(&h.latency),
        "cost_usd": h.cost_usd,
    })
}

/// One saved bin.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedBin {
    pub head: Head,
    pub cells: Vec<Cell>,
    pub keys: Vec<KeyCell>,
}

/// One interface's saved minute ring.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SavedInterface {
    pub bin_ms: u64,
    pub providers: Vec<String>,
    pub keys: Vec<String>,
    pub bins: Vec<SavedBin>,
}

/// The minute rings of every interface, as the state file keeps them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Saved {
    pub version: u32,
    pub interfaces: std::collections::BTreeMap<String, SavedInterface>,
}

#[cfg(test)]
mod tests;
