//! The live dashboard: `GET /dashboard`, one self-contained page (HTML, CSS, JavaScript and
//! hand-drawn SVG charts, nothing fetched from elsewhere), and `GET /dashboard/data`, the JSON
//! the page polls every second. Both take the admin keys, like the state routes; they also take
//! the key as HTTP Basic (any user name, the key as password), because a browser cannot send a
//! bearer key when it opens a page.
//!
//! Each interface keeps a [`History`] of fixed size, allocated at start: a ring of [`BINS`]
//! one-second bins of counts per provider, the last [`DECISIONS`] decisions and the last
//! [`FALLBACKS`] fallbacks and the last [`SHIFTS`] quality shifts. The estimates, breaker states and scores come from the state route
//! (`/v1/interfaces/{name}/state`), not from a second copy of its logic.

use super::audit::AuditRecord;
use super::error::ApiError;
use super::state::{AppState, InterfaceRuntime};
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use equiroute_core::executor::{AttemptRecord, RequestStatus};
use equiroute_core::policies::ScoreBreakdown;
use equiroute_core::{AttemptStatus, Timestamp};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
/// After a poll of the data route, every request's decision is kept for this long; with nobody
/// watching only the counts (and the fallbacks) are, so an unwatched dashboard costs the
/// request path no allocation.
const WATCHED_MS: f64 = 60_000.0;

/// The page, compiled into the binary.
const PAGE: &str = include_str!("dashboard.html");

/// One provider's counts in one bin.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Cell {
    /// Requests that ranked it first.
    first: u32,
    attempts: u32,
    /// Attempts that failed on the provider's side (errors, timeouts, and rejections another
    /// provider disputed by answering the request).
    failures: u32,
    /// Attempts it answered.
    answered: u32,
    /// Sum of the latencies of the answered attempts.
    latency_ms: f64,
    /// Sum of what its attempts cost.
    cost_usd: f64,
}

/// One bin's interface-wide counts.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Head {
    /// The bin's number (milliseconds since the Unix epoch / [`BIN_MS`]) plus one; 0: unused.
    number: u64,
    requests: u32,
    /// Requests that ended without an answer.
    failed: u32,
    deadline_missed: u32,
    /// Requests that moved on to another provider after an attempt failed.
    fallbacks: u32,
    cost_usd: f64,
}

#[derive(Debug)]
struct Ring {
    heads: Vec<Head>,
    /// `BINS × providers`, bin-major.
    cells: Vec<Cell>,
    providers: usize,
    decisions: VecDeque<Value>,
    fallbacks: VecDeque<Value>,
    shifts: VecDeque<Value>,
}

impl Ring {
    /// The bin that holds `at`, cleared first when it last held an older second.
    fn bin(&mut self, at: Timestamp) -> usize {
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
    ring: Mutex<Ring>,
    /// Until when (ms since the Unix epoch, as bits of an `f64`) decisions are kept in full.
    watched_until: AtomicU64,
}

/// Whether a request moved to another provider after a failed attempt (a retry of the same
/// provider is not a fallback).
fn fell_back(attempts: &[AttemptRecord]) -> bool {
    attempts.iter().skip(1).any(|a| a.retry.is_none())
}

impl History {
    /// An empty history for an interface of `providers` providers.
    #[must_use]
    pub fn new(providers: usize) -> History {
        History {
            ring: Mutex::new(Ring {
                heads: vec![Head::default(); BINS],
                cells: vec![Cell::default(); BINS * providers],
                providers,
                decisions: VecDeque::with_capacity(DECISIONS),
                fallbacks: VecDeque::with_capacity(FALLBACKS),
                shifts: VecDeque::with_capacity(SHIFTS),
            }),
            watched_until: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Counts one finished request, ended at `at`, whose first choice was `first`.
    pub fn count(
        &self,
        at: Timestamp,
        first: Option<usize>,
        attempts: &[AttemptRecord],
        status: RequestStatus,
    ) {
        let Ok(mut ring) = self.ring.lock() else {
            return;
        };
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

    /// Marks the dashboard as watched at `now`.
    fn watch(&self, now: Timestamp) {
        self.watched_until
            .store((now.0 + WATCHED_MS).to_bits(), Ordering::Relaxed);
    }

    /// The last [`BINS`] seconds up to `now`, oldest first, with the kept decisions,
    /// fallbacks and quality shifts, newest first.
    fn view(&self, now: Timestamp, ids: &[String]) -> Value {
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

/// The dashboard's routes, behind the admin keys (bearer or HTTP Basic).
pub fn routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/dashboard", get(page))
        .route("/dashboard/data", get(data))
        .route_layer(middleware::from_fn_with_state(state, require_admin_key))
}

async fn page() -> Response {
    let mut resp = Html(PAGE).into_response();
    let h = resp.headers_mut();
    h.insert("cache-control", HeaderValue::from_static("no-store"));
    // The page is all inline: nothing else may run in it or be loaded by it.
    h.insert(
        "content-security-policy",
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:",
        ),
    );
    resp
}

/// `GET /dashboard/data`: per interface, the state route's summary, the time series, the
/// kept decisions and fallbacks, and why the leader leads.
async fn data(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let now = state.now();
    let mut interfaces = Vec::with_capacity(state.interfaces.len());
    for iface in state.interfaces.values() {
        iface.history.watch(now);
        let Json(summary) = super::interface_state(
            State(state.clone()),
            Path(iface.name.clone()),
            RawQuery(None),
        )
        .await?;
        let ids: Vec<String> = iface.candidates.iter().map(|c| c.id.0.clone()).collect();
        let mut entry = iface.history.view(now, &ids);
        entry["name"] = json!(iface.name);
        entry["kind"] = json!(iface.kind);
        entry["policy"] = json!(iface.policy_name());
        entry["deadline_ms"] = json!(iface.deadline.map(|d| d.0));
        entry["providers"] = json!(iface
            .candidates
            .iter()
            .map(|c| json!({"id": c.id, "model": c.model, "tier": c.tier, "price": c.price}))
            .collect::<Vec<_>>());
        entry["leader"] = leader(iface, &summary["candidates"], now);
        entry["candidates"] = summary["candidates"].clone();
        interfaces.push(entry);
    }
    Ok(Json(json!({
        "now_ms": now.0,
        "audit_dropped": state.audit.as_ref().map(super::audit::AuditLog::dropped),
        "interfaces": interfaces,
    })))
}

/// One ranked candidate of the state route's summary.
#[derive(Debug)]
struct Ranked {
    id: String,
    score: f64,
    estimates: ScoreBreakdown,
    breaker: Option<Value>,
}

impl Ranked {
    /// From the state route's JSON (the breakdown leaves out what a policy does not estimate).
    fn from_json(v: &Value) -> Option<Ranked> {
        let e = &v["estimates"];
        Some(Ranked {
            id: v["id"].as_str()?.to_owned(),
            score: v["score"].as_f64()?,
            estimates: ScoreBreakdown {
                quality: e["quality"].as_f64(),
                exploration: e["exploration"].as_f64(),
                latency_ms: e["latency_ms"].as_f64(),
                latency_unseen: e["latency_unseen"].as_bool().unwrap_or(false),
                failure_probability: e["failure_probability"].as_f64(),
                deadline_miss_probability: e["deadline_miss_probability"].as_f64(),
                bad_probability: e["bad_probability"].as_f64(),
                cost_usd: e["cost_usd"].as_f64(),
                guarded: e["guarded"].as_bool().unwrap_or(false),
                warmup: e["warmup"].as_bool().unwrap_or(false),
                retest: e["retest"].as_bool().unwrap_or(false),
            },
            breaker: v.get("breaker").cloned(),
        })
    }

    fn open_until(&self) -> Option<f64> {
        let b = self.breaker.as_ref()?;
        (b["state"] == "open").then(|| b["until"].as_f64().unwrap_or(0.0))
    }
}

/// The provider that requests go to first now, and one line in plain words on why.
fn leader(iface: &InterfaceRuntime, candidates: &Value, now: Timestamp) -> Value {
    let ranked: Vec<Ranked> = candidates
        .as_array()
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .filter_map(Ranked::from_json)
        .collect();
    match explain(&ranked, iface.deadline.map(|d| d.0), now) {
        Some((id, why)) => json!({"id": id, "why": why}),
        None => Value::Null,
    }
}

/// `(leader, why)`: the best-ranked provider whose breaker is not open, and how it beats the
/// next one on the estimates behind the scores.
fn explain(
    ranked: &[Ranked],
    deadline_ms: Option<f64>,
    now: Timestamp,
) -> Option<(String, String)> {
    let mut open = Vec::new();
    let mut usable = ranked.iter().filter(|r| match r.open_until() {
        Some(until) if until > now.0 => {
            open.push(r.id.as_str());
            false
        }
        _ => true,
    });
    let lead = usable.next()?;
    let next = usable.next();
    let mut why = match next {
        None => format!("{} is the only provider that can take requests now", lead.id),
        Some(_) if lead.estimates.warmup => format!(
            "{} goes first to collect its first quality scores (warm-up), not because it is known to be better",
            lead.id
        ),
        Some(next) => {
            let (a, b) = (&lead.estimates, &next.estimates);
            let mut better = Vec::new();
            if let (Some(x), Some(y)) = (a.quality, b.quality) {
                if x > y + 0.005 {
                    better.push(format!("better answers (quality {x:.2} vs {y:.2})"));
                }
            }
            // A prior is not a latency: "faster" compares what was seen.
            let seen = |e: &ScoreBreakdown| e.latency_ms.filter(|_| !e.latency_unseen);
            if let (Some(x), Some(y)) = (seen(a), seen(b)) {
                if x < 0.9 * y {
                    better.push(format!("faster ({x:.0} ms vs {y:.0} ms typical)"));
                }
            }
            if let (Some(x), Some(y)) = (a.deadline_miss_probability, b.deadline_miss_probability)
            {
                if x + 0.005 < y {
                    let d = deadline_ms.map_or(String::new(), |d| format!(" the {d:.0} ms"));
                    better.push(format!(
                        "less likely to miss{d} deadline ({:.1}% vs {:.1}%)",
                        100.0 * x,
                        100.0 * y
                    ));
                }
            }
            if let (Some(x), Some(y)) = (a.failure_probability, b.failure_probability) {
                if x + 0.005 < y {
                    better.push(format!(
                        "fails less ({:.1}% vs {:.1}%)",
                        100.0 * x,
                        100.0 * y
                    ));
                }
            }
            if let (Some(x), Some(y)) = (a.cost_usd, b.cost_usd) {
                if x < 0.9 * y {
                    better.push(format!("cheaper (${x:.6} vs ${y:.6} a call)"));
                }
            }
            let head = format!(
                "{} leads {} on score ({:.3} vs {:.3})",
                lead.id, next.id, lead.score, next.score
            );
            if better.is_empty() {
                format!("{head}: they are close on every estimate, so the lead is the policy exploring and may change")
            } else {
                format!("{head}: it is {}", better.join(", "))
            }
        }
    };
    if !open.is_empty() {
        why = format!(
            "{why}; circuit open (resting after failures): {}",
            open.join(", ")
        );
    }
    Some((lead.id.clone(), why))
}

/// The admin keys (as the state routes take them), as a bearer key or as the password of
/// HTTP Basic; a browser is asked for them.
async fn require_admin_key(
    State(state): State<Arc<AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
    let basic = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| decode_base64(b.trim()))
        .and_then(|raw| {
            let text = String::from_utf8(raw).ok()?;
            text.split_once(':').map(|(_, pass)| pass.to_owned())
        });
    let route = super::auth::Route::Admin;
    let caller = match basic {
        Some(pass) => state.keys.identify(pass.as_bytes(), route),
        None => state.keys.caller(req.headers(), route, false),
    };
    if let Some(caller) = caller {
        req.extensions_mut().insert(caller);
        return next.run(req).await;
    }
    let mut resp = ApiError::unauthorized_admin(state.keys.has_admin_keys()).into_response();
    resp.headers_mut().insert(
        "www-authenticate",
        HeaderValue::from_static(
            "Basic realm=\"equiroute dashboard (password: an admin key)\", charset=\"UTF-8\"",
        ),
    );
    debug_assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    resp
}

/// Standard base64 (padding optional); `None` for anything else.
#[must_use]
pub fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let text = text.trim_end_matches('=');
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes() {
        acc = (acc << 6) | u32::from(value(c)?);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
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

    #[test]
    fn a_fallback_is_counted_in_its_second_and_old_seconds_fall_out_of_the_ring() {
        let h = History::new(2);
        let failed = AttemptStatus::ProviderError(ProviderFailure::Server);
        let t = Timestamp(1_000_000.0);
        // a fails, b answers: a fallback, first choice a.
        h.count(
            t,
            Some(0),
            &[
                attempt(0, failed, None),
                attempt(1, AttemptStatus::Ok, None),
            ],
            RequestStatus::Succeeded { candidate: 1 },
        );
        // a retried once on itself: not a fallback.
        h.count(
            Timestamp(t.0 + 500.0),
            Some(0),
            &[
                attempt(0, failed, None),
                attempt(0, AttemptStatus::Ok, Some(RetryReason::ServerError)),
            ],
            RequestStatus::Succeeded { candidate: 0 },
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
            &[
                attempt(1, rejected, None),
                attempt(0, AttemptStatus::Ok, None),
            ],
            RequestStatus::Succeeded { candidate: 0 },
        );
        h.count(
            Timestamp(t.0 + 700.0),
            Some(1),
            &[attempt(1, rejected, None), attempt(0, rejected, None)],
            RequestStatus::ClientError { candidate: 0 },
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
            &[attempt(1, AttemptStatus::Ok, None)],
            RequestStatus::Succeeded { candidate: 1 },
        );
        let reused = h.view(Timestamp(t.0 + 1000.0 * BINS as f64), &ids);
        assert_eq!(reused["series"]["requests"][BINS - 1], 1);
        assert_eq!(reused["series"]["providers"]["a"]["first"][BINS - 1], 0);
    }

    #[test]
    fn decisions_are_kept_only_while_watched_and_fallbacks_always_both_bounded() {
        let h = History::new(2);
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

    fn ranked(id: &str, score: f64, estimates: ScoreBreakdown, breaker: Value) -> Ranked {
        Ranked {
            id: id.into(),
            score,
            estimates,
            breaker: Some(breaker),
        }
    }

    #[test]
    fn a_latency_prior_is_never_called_faster() {
        let seen = ScoreBreakdown {
            latency_ms: Some(40.0),
            ..ScoreBreakdown::default()
        };
        let prior = ScoreBreakdown {
            latency_ms: Some(1000.0),
            latency_unseen: true,
            ..ScoreBreakdown::default()
        };
        let closed = json!({"state": "closed"});
        let explained = |a: ScoreBreakdown, b: ScoreBreakdown| {
            explain(
                &[
                    ranked("a", 0.9, a, closed.clone()),
                    ranked("b", 0.7, b, closed.clone()),
                ],
                None,
                Timestamp(0.0),
            )
            .unwrap()
            .1
        };
        assert!(!explained(seen, seen).contains("faster"), "equal latencies");
        let prior_faster = ScoreBreakdown {
            latency_ms: Some(10.0),
            ..prior
        };
        assert!(
            !explained(prior_faster, seen).contains("faster"),
            "a's 10 ms is a prior"
        );
        assert!(
            !explained(seen, prior).contains("faster"),
            "b's 1000 ms is a prior"
        );
        let slow = ScoreBreakdown {
            latency_ms: Some(1000.0),
            ..seen
        };
        assert!(explained(seen, slow).contains("faster (40 ms vs 1000 ms typical)"));
    }

    #[test]
    fn the_leader_is_explained_by_the_estimates_it_wins_on_and_an_open_breaker_is_skipped() {
        let fast = ScoreBreakdown {
            quality: Some(0.80),
            latency_ms: Some(40.0),
            deadline_miss_probability: Some(0.001),
            cost_usd: Some(0.0001),
            ..ScoreBreakdown::default()
        };
        let slow = ScoreBreakdown {
            quality: Some(0.80),
            latency_ms: Some(120.0),
            deadline_miss_probability: Some(0.02),
            cost_usd: Some(0.0001),
            ..ScoreBreakdown::default()
        };
        let closed = json!({"state": "closed"});
        let now = Timestamp(10_000.0);
        let (id, why) = explain(
            &[
                ranked("a", 0.9, fast, closed.clone()),
                ranked("b", 0.7, slow, closed.clone()),
            ],
            Some(6000.0),
            now,
        )
        .unwrap();
        assert_eq!(id, "a");
        assert_eq!(
            why,
            "a leads b on score (0.900 vs 0.700): it is faster (40 ms vs 120 ms typical), less likely to miss the 6000 ms deadline (0.1% vs 2.0%)"
        );
        // The best score behind an open breaker does not lead.
        let (id, why) = explain(
            &[
                ranked("a", 0.9, fast, json!({"state": "open", "until": 20_000.0})),
                ranked("b", 0.7, slow, closed.clone()),
            ],
            Some(6000.0),
            now,
        )
        .unwrap();
        assert_eq!(id, "b");
        assert_eq!(
            why,
            "b is the only provider that can take requests now; circuit open (resting after failures): a"
        );
        let warm = ScoreBreakdown {
            warmup: true,
            ..slow
        };
        let (_, why) = explain(
            &[
                ranked("b", 0.7, warm, closed.clone()),
                ranked("a", 0.6, fast, closed),
            ],
            None,
            now,
        )
        .unwrap();
        assert!(why.contains("warm-up"), "{why}");
    }

    #[test]
    fn basic_credentials_decode_as_base64() {
        assert_eq!(decode_base64("YWRtaW46czNjcmV0").unwrap(), b"admin:s3cret");
        assert_eq!(decode_base64("eDp5eg==").unwrap(), b"x:yz");
        assert!(decode_base64("not base64!").is_none());
    }
}
