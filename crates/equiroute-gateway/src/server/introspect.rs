//! Introspect: the read-only routes about the gateway rather than through it: the models and
//! interfaces lists, an interface's learnt state (`/v1/interfaces/{name}/state`, paged, one
//! full dump at a time), readiness and `/metrics`.

use super::arms;
use super::error::{echo, ApiError};
use super::state::{AppState, InterfaceRuntime};
use crate::config::InterfaceKind;
use axum::extract::{Path, State};
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};
use axum::Json;
use equiroute_core::policies::RankContext;
use serde_json::{json, Value};
use std::sync::Arc;

/// The OpenAI model objects: each chat interface (routed), then each of its providers
/// pinned as `interface/provider`.
pub(super) fn model_objects(state: &AppState) -> Vec<Value> {
    let mut out = Vec::new();
    for i in state
        .interfaces()
        .values()
        .filter(|i| i.kind == InterfaceKind::Chat)
    {
        out.push(json!({"id": i.name, "object": "model", "created": 0, "owned_by": "equiroute"}));
        for c in &i.candidates {
            out.push(json!({
                "id": format!("{}/{}", i.name, c.id.0),
                "object": "model",
                "created": 0,
                "owned_by": c.model,
            }));
        }
    }
    out
}

/// `GET /v1/models`: what `model` can name, as OpenAI lists models.
pub(super) async fn list_models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": model_objects(&state)}))
}

/// `GET /v1/models/{model}`: one of them (`chat` or `chat/provider`).
pub(super) async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let mut all = model_objects(&state);
    if let Some(at) = all.iter().position(|m| m["id"] == model.as_str()) {
        return Ok(Json(all.swap_remove(at)));
    }
    let ids: Vec<&str> = all.iter().filter_map(|m| m["id"].as_str()).collect();
    Err(ApiError::not_found(
        "model_not_found",
        format!("no model `{}`: use one of {}", echo(&model), ids.join(", ")),
    ))
}

pub(super) async fn list_interfaces(State(state): State<Arc<AppState>>) -> Json<Value> {
    let list: Vec<Value> = state
        .interfaces()
        .values()
        .map(|i| {
            json!({
                "name": i.name,
                "kind": i.kind,
                "policy": i.policy_name(),
                "deadline_ms": i.deadline.map(|d| d.0),
                "providers": i.candidates.iter().map(|c| json!({"id": c.id, "model": c.model, "tier": c.tier, "price": c.price})).collect::<Vec<_>>(),
            })
        })
        .collect();
    Json(json!({"interfaces": list}))
}

/// The most slices one page of `?full=true` carries, and its default `limit`.
pub const STATE_PAGE_MAX: usize = 1000;

/// The query of `GET /v1/interfaces/{name}/state`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct StateQuery {
    pub(super) full: bool,
    /// First slice of the page (`offset`, default 0).
    pub(super) offset: usize,
    /// Slices in the page (`limit`, 1 to [`STATE_PAGE_MAX`], default the most).
    pub(super) limit: usize,
}

/// Parses the state route's query. Any fault is an OpenAI-style 400 naming the parameter
/// (axum's own rejection is plain text).
pub(super) fn parse_state_query(raw: Option<&str>) -> Result<StateQuery, ApiError> {
    let mut q = StateQuery {
        full: false,
        offset: 0,
        limit: STATE_PAGE_MAX,
    };
    let bad = |param: &'static str, what: &str, got: &str| {
        ApiError::bad_request(
            "invalid_query",
            Some(param),
            format!("`{param}` must be {what}, got `{}`", echo(got)),
        )
    };
    for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "full" => {
                q.full = match value {
                    "true" | "1" => true,
                    "false" | "0" => false,
                    _ => return Err(bad("full", "true, false, 1 or 0", value)),
                };
            }
            "offset" => {
                q.offset = value
                    .parse()
                    .map_err(|_| bad("offset", "a whole number of slices", value))?;
            }
            "limit" => {
                q.limit = value
                    .parse()
                    .ok()
                    .filter(|l| (1..=STATE_PAGE_MAX).contains(l))
                    .ok_or_else(|| bad("limit", "a whole number from 1 to 1000", value))?;
            }
            other => {
                return Err(ApiError::bad_field(
                    "invalid_query",
                    echo(other).into_owned(),
                    format!(
                    "unknown query parameter `{}`: the state route takes full, offset and limit",
                    echo(other)
                ),
                ))
            }
        }
    }
    Ok(q)
}

/// The one full state dump a gateway builds at a time: taken before the dump is started,
/// released when the blocking task that builds it ends (even if the client has gone).
pub(super) struct FullDump(Arc<AppState>);

impl FullDump {
    pub(super) fn begin(state: &Arc<AppState>) -> Option<FullDump> {
        state
            .full_dump_busy
            .compare_exchange(
                false,
                true,
                std::sync::atomic::Ordering::Acquire,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
            .then(|| FullDump(state.clone()))
    }
}

impl Drop for FullDump {
    fn drop(&mut self) {
        self.0
            .full_dump_busy
            .store(false, std::sync::atomic::Ordering::Release);
    }
}

/// The slices of a learning state (sliced policies only).
pub(super) fn slices_of(
    learnt: &mut equiroute_core::policies::PolicyState,
) -> Option<&mut Vec<equiroute_core::policies::SliceStats>> {
    use equiroute_core::policies::PolicyState;
    match learnt {
        PolicyState::TsDeadline(risk) => Some(&mut risk.slices),
        PolicyState::LqmTs(s) => Some(&mut s.risk.slices),
        _ => None,
    }
}

/// One page of an interface's learning state: everything but the latency slices, and the
/// slices from `offset`, at most `limit` of them. Runs on a blocking thread.
pub(super) fn learning_page(
    iface: &InterfaceRuntime,
    offset: usize,
    limit: usize,
) -> Result<Value, ApiError> {
    let mut learnt = iface
        .policy
        .read()
        .map_err(|_| ApiError::internal())?
        .export_state();
    let page = slices_of(&mut learnt).map(|slices| {
        let total = slices.len();
        let end = offset.saturating_add(limit).min(total);
        slices.truncate(end);
        slices.drain(..offset.min(end));
        json!({
            "total": total,
            "offset": offset,
            "limit": limit,
            "next_offset": (end < total).then_some(end),
        })
    });
    let mut out = json!({"learning_state": learnt});
    if let Some(page) = page {
        out["slices_page"] = page;
    }
    Ok(out)
}

/// A candidate's estimates for the state route: its score breakdown, with the number of
/// quality scores behind the quality estimate (for policies that learn one) and the estimate
/// itself `null` while that number is 0, since it is then only the policy's prior.
pub(super) fn estimates_json(
    breakdown: &equiroute_core::policies::ScoreBreakdown,
    quality_observations: Option<u64>,
) -> Value {
    let mut estimates = json!(breakdown);
    if let (Some(n), Some(map)) = (quality_observations, estimates.as_object_mut()) {
        if n == 0 && map.contains_key("quality") {
            map.insert("quality".to_owned(), Value::Null);
        }
        map.insert("quality_observations".to_owned(), json!(n));
    }
    estimates
}

/// `GET /v1/interfaces/{name}/state`: each candidate's current estimates (from the policy's
/// view of an empty query at the interface deadline), breaker state and traffic share.
/// A quality estimate that rests on no score yet is `null` (the policy ranks by its prior
/// meanwhile), next to the count of scores behind it; the traffic counts cover this process
/// since it started (`traffic_window`), as they are neither saved nor shared.
/// `?full=true` adds the policy's learning state, its latency slices paged by `offset` and
/// `limit`; it is built on a blocking thread, one at a time per gateway (a second gets 429).
pub(super) async fn interface_state(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
    axum::extract::RawQuery(raw): axum::extract::RawQuery,
) -> Result<Json<Value>, ApiError> {
    let query = parse_state_query(raw.as_deref())?;
    let iface = state.interface(&name).ok_or_else(|| {
        ApiError::not_found(
            "interface_not_found",
            format!("no interface `{}`", echo(&name)),
        )
    })?;
    let features = iface.featurizer.featurize("");
    let all: Vec<usize> = (0..iface.candidates.len()).collect();
    let (ranking, quality_observations) = {
        // The write side, so that observations deferred by busy requests are in the state shown.
        let policy = state.policy_mut(&iface).map_err(|_| ApiError::internal())?;
        let mut ctx = RankContext::new(&iface.candidates, &all, &features);
        ctx.deadline = iface.deadline;
        ctx.now = state.now();
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
        (policy.rank(&ctx, &mut rng), policy.quality_observations())
    };
    let breakers = iface.breakers.lock().map(|b| b.clone()).unwrap_or_default();
    let total: u64 = iface
        .first_choices
        .iter()
        .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    let candidates: Vec<Value> = ranking
        .order
        .iter()
        .map(|s| {
            let c = &iface.candidates[s.index];
            let first = iface.first_choices[s.index].load(std::sync::atomic::Ordering::Relaxed);
            json!({
                "id": c.id,
                "score": s.score,
                "estimates": estimates_json(&s.breakdown, quality_observations.as_ref().and_then(|n| n.get(s.index).copied())),
                "breaker": breakers.get(s.index).map(|b| b.state),
                "first_choices": first,
                "traffic_share": (total > 0).then(|| first as f64 / total as f64),
            })
        })
        .collect();
    let mut body = json!({
        "interface": name,
        "policy": iface.policy_name(),
        "candidates": candidates,
        "traffic_window": {
            "scope": "process",
            "since_unix_ms": state.started_unix_ms(),
            "requests": total,
        },
    });
    if query.full {
        let Some(dump) = FullDump::begin(&state) else {
            return Err(ApiError::busy(
                "state_dump_in_progress",
                "another full state dump is being built (one at a time): retry after a second, or leave out full=true for the summary",
            ));
        };
        let page = tokio::task::spawn_blocking(move || {
            let _dump = dump;
            learning_page(&iface, query.offset, query.limit)
        })
        .await
        .map_err(|_| ApiError::internal())??;
        if let (Some(b), Value::Object(p)) = (body.as_object_mut(), page) {
            b.extend(p);
        }
    }
    Ok(Json(body))
}

/// Ready to serve. With shared state, the body says whether Redis is reachable: an instance
/// without Redis still routes (on its local state), so it stays ready.
pub(super) async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    match &state.shared {
        None => "ready".into_response(),
        Some(shared) => Json(json!({
            "status": "ready",
            "state": shared.readiness(state.now()),
        }))
        .into_response(),
    }
}

pub(super) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut text = state.metrics.render();
    arms::render_metrics(&**state.interfaces(), &mut text);
    if let Some(shared) = &state.shared {
        shared.render_metrics(&mut text);
    }
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use axum::http::StatusCode;

    const CONFIG: &str = r#"
[interfaces.chat]
kind = "chat"
policy = { name = "ts-deadline" }

[[interfaces.chat.providers]]
id = "a"
kind = "sim"
sim = { latency = { p50_ms = 1, p95_ms = 2 } }
"#;

    async fn full_state(state: &Arc<AppState>) -> Response {
        interface_state(
            State(state.clone()),
            Path("chat".to_owned()),
            axum::extract::RawQuery(Some("full=true".to_owned())),
        )
        .await
        .into_response()
    }

    #[tokio::test]
    async fn one_full_state_dump_at_a_time_the_second_gets_429_with_retry_after() {
        let cfg = crate::config::load(CONFIG, "t.toml", &|_| None).unwrap();
        let state = Arc::new(AppState::new(&cfg, 1).unwrap());
        let dump = FullDump::begin(&state).expect("free");
        assert!(FullDump::begin(&state).is_none(), "a second dump waits");
        let busy = full_state(&state).await;
        assert_eq!(busy.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(busy.headers().get("retry-after").unwrap(), "1");
        let body = axum::body::to_bytes(busy.into_body(), 1 << 16)
            .await
            .unwrap();
        let e: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(e["error"]["code"], "state_dump_in_progress");
        // The summary is never refused.
        let summary = interface_state(
            State(state.clone()),
            Path("chat".to_owned()),
            axum::extract::RawQuery(None),
        )
        .await;
        assert!(summary.is_ok());
        drop(dump);
        let done = full_state(&state).await;
        assert_eq!(done.status(), StatusCode::OK);
        // The dump released its turn when it ended.
        assert!(FullDump::begin(&state).is_some());
    }
}
