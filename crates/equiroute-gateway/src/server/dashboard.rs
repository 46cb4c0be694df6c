//! The live dashboard: `GET /dashboard`, one self-contained page (HTML, CSS, JavaScript and
//! hand-drawn SVG charts, nothing fetched from elsewhere), and `GET /dashboard/data`, the JSON
//! the page polls every second. Both take the admin keys, like the state routes; they also take
//! the key as HTTP Basic (any user name, the key as password), because a browser cannot send a
//! bearer key when it opens a page.
//!
//! `GET /dashboard/ops?horizon=5m|1h|24h` is the operations view's data (see [`super::ops`]):
//! per interface, volume, latency quantiles, errors by class, spend, tokens, quality and the
//! marked changes over the horizon (5 minutes at one second, 1 or 24 hours at one minute),
//! with the totals of the last hour and day, per provider and per configured key.
//!
//! The traffic series come from each interface's [`History`](super::history::History); the
//! estimates, breaker states and scores from the state route (`/v1/interfaces/{name}/state`),
//! not from a second copy of its logic.

use super::error::ApiError;
use super::state::{AppState, InterfaceRuntime};
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use equiroute_core::policies::ScoreBreakdown;
use equiroute_core::Timestamp;
use serde_json::{json, Value};
use std::sync::Arc;

/// The page, compiled into the binary.
const PAGE: &str = include_str!("dashboard.html");

/// The dashboard's routes, behind the admin keys (bearer or HTTP Basic).
pub fn routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/dashboard", get(page))
        .route("/dashboard/data", get(data))
        .route("/dashboard/ops", get(operations))
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
    // One snapshot of the interfaces for the page (a reload may swap them meanwhile).
    let served = state.interfaces_full();
    let mut interfaces = Vec::with_capacity(served.len());
    for iface in served.values() {
        iface.history.watch(now);
        let Json(summary) = super::introspect::interface_state(
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
        "started_ms": state.started_unix_ms(),
        "audit_dropped": state.audit.as_ref().map(super::audit::AuditLog::dropped),
        "config": state.config_version(),
        "interfaces": interfaces,
    })))
}

/// The horizons the operations view offers, as `horizon=` names them.
const HORIZONS: [(&str, u64); 3] = [("5m", 300_000), ("1h", 3_600_000), ("24h", 86_400_000)];

/// The horizon of `horizon=NAME` in the query (default 5 minutes).
///
/// # Errors
/// 400 naming the parameter and the values it takes.
fn horizon(query: Option<&str>) -> Result<u64, ApiError> {
    let given = query
        .unwrap_or("")
        .split('&')
        .find_map(|pair| pair.strip_prefix("horizon="));
    let Some(given) = given else {
        return Ok(HORIZONS[0].1);
    };
    HORIZONS
        .iter()
        .find(|(name, _)| *name == given)
        .map(|(_, ms)| *ms)
        .ok_or_else(|| {
            ApiError::bad_request(
                "invalid_horizon",
                Some("horizon"),
                format!(
                    "`horizon` is `{}`: use 5m, 1h or 24h",
                    super::error::echo(given)
                ),
            )
        })
}

/// `GET /dashboard/ops`: the operations view of every interface over the horizon.
async fn operations(
    State(state): State<Arc<AppState>>,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, ApiError> {
    let horizon_ms = horizon(query.as_deref())?;
    let now = state.now();
    let interfaces: Vec<Value> = state
        .interfaces()
        .values()
        .map(|iface| {
            let ids: Vec<String> = iface.candidates.iter().map(|c| c.id.0.clone()).collect();
            let mut v = iface
                .history
                .operations(now, state.started_unix_ms(), horizon_ms, &ids);
            v["name"] = json!(iface.name);
            v
        })
        .collect();
    Ok(Json(json!({
        "now_ms": now.0,
        "started_ms": state.started_unix_ms(),
        "horizon_ms": horizon_ms,
        "error_classes": super::ops::ERROR_CLASSES.map(super::ops::ErrorClass::name),
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
    fn the_horizon_is_one_of_three_and_anything_else_is_refused_by_name() {
        assert_eq!(horizon(None).unwrap(), 300_000);
        assert_eq!(horizon(Some("horizon=1h")).unwrap(), 3_600_000);
        assert_eq!(horizon(Some("x=1&horizon=24h")).unwrap(), 86_400_000);
        let e = horizon(Some("horizon=7d")).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("horizon"));
        assert!(e.message.contains("use 5m, 1h or 24h"), "{}", e.message);
    }

    #[test]
    fn basic_credentials_decode_as_base64() {
        assert_eq!(decode_base64("YWRtaW46czNjcmV0").unwrap(), b"admin:s3cret");
        assert_eq!(decode_base64("eDp5eg==").unwrap(), b"x:yz");
        assert!(decode_base64("not base64!").is_none());
    }
}
