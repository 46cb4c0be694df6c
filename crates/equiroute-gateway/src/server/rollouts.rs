//! The admin routes of an interface's shadow and canary rollout (behind the admin keys, like
//! the state route):
//!
//! - `GET /v1/interfaces/{name}/shadow`: the shadow's agreement with the live policy;
//! - `GET /v1/interfaces/{name}/rollout`: the rollout's state, each arm's measurements and
//!   the guard's intervals;
//! - `POST /v1/interfaces/{name}/rollout/promote`: the candidate becomes the live policy (the
//!   state file keeps the promotion across restarts; the configuration should say it too);
//! - `POST /v1/interfaces/{name}/rollout/abort`: every request goes to the live policy again.
//!
//! With learning state shared through Redis, a promotion or abort (and a rollback by the
//! guard) is journaled and reaches every instance within a sync interval (see
//! [`crate::shared`]).

use super::error::{echo, ApiError};
use super::state::{AppState, InterfaceRuntime};
use axum::extract::{Path, State};
use axum::Json;
use equiroute_core::ope::Estimator;
use equiroute_core::policies::RankContext;
use serde_json::{json, Value};
use std::sync::Arc;

fn interface(state: &AppState, name: &str) -> Result<Arc<InterfaceRuntime>, ApiError> {
    state.interface(name).ok_or_else(|| {
        ApiError::not_found(
            "interface_not_found",
            format!("no interface `{}`", echo(name)),
        )
    })
}

/// `GET /v1/interfaces/{name}/shadow`.
pub(super) async fn shadow(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let iface = interface(&state, &name)?;
    let Some(shadow) = &iface.arms.shadow else {
        return Err(ApiError::not_found(
            "no_shadow",
            format!("interface `{name}` runs no shadow policy: add `shadow = \"NAME\"` (or a table like `policy`) to [interfaces.{name}]"),
        ));
    };
    // The shadow's ranking of an empty request with every candidate, as the state route
    // shows the live policy's: its estimates, from the write side so that queued
    // observations are in.
    let features = iface.featurizer.featurize("");
    let all: Vec<usize> = (0..iface.candidates.len()).collect();
    let ranking = {
        let policy = shadow.policy.write()?;
        let mut ctx = RankContext::new(&iface.candidates, &all, &features);
        ctx.deadline = iface.deadline;
        ctx.now = state.now();
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
        policy.rank(&ctx, &mut rng)
    };
    let candidates: Vec<Value> = ranking
        .order
        .iter()
        .map(|s| {
            let mut c = serde_json::to_value(s.breakdown).unwrap_or_else(|_| json!({}));
            c["id"] = json!(iface.candidates[s.index].id);
            c["score"] = json!(s.score);
            c
        })
        .collect();
    // Bootstrap and cross-fitting over the window: off the event loop.
    let estimate =
        {
            let iface = iface.clone();
            tokio::task::spawn_blocking(move || {
                iface.arms.shadow.as_ref().map(|s| {
                    s.estimates(&iface.candidates, &[Estimator::Snips, Estimator::Dr], 400)
                })
            })
            .await
            .map_err(|_| ApiError::internal())?
        };
    let mut body = shadow.report();
    if let Some(b) = body.as_object_mut() {
        b.insert("estimate".into(), json!(estimate));
        b.insert("candidates".into(), json!(candidates));
        b.insert("interface".into(), json!(name));
        b.insert("live_policy".into(), json!(iface.policy_name()));
        b.insert(
            "traffic_window".into(),
            json!({"scope": "process", "since_unix_ms": state.started_unix_ms()}),
        );
    }
    Ok(Json(body))
}

fn rollout_of<'a>(
    iface: &'a InterfaceRuntime,
    name: &str,
) -> Result<&'a super::arms::Rollout, ApiError> {
    iface.arms.rollout.as_ref().ok_or_else(|| {
        ApiError::not_found(
            "no_rollout",
            format!("interface `{name}` has no rollout: add `rollout = {{ policy = \"NAME\", percent = 5 }}` to [interfaces.{name}]"),
        )
    })
}

/// `GET /v1/interfaces/{name}/rollout`.
pub(super) async fn rollout(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let iface = interface(&state, &name)?;
    let mut body = rollout_of(&iface, &name)?.report();
    if let Some(b) = body.as_object_mut() {
        b.insert("interface".into(), json!(name));
        b.insert("live_policy".into(), json!(iface.policy_name()));
    }
    Ok(Json(body))
}

/// `POST /v1/interfaces/{name}/rollout/promote`: swaps the live policy for the candidate (its
/// configuration and learnt state) in memory.
pub(super) async fn promote(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let iface = interface(&state, &name)?;
    let rollout = rollout_of(&iface, &name)?;
    end_by_operator(&state, &iface, true)?;
    let policy = rollout.policy.kind.as_str();
    let note = if state.shared.is_some() {
        format!("promoted here, and on every instance sharing the state through Redis within a sync interval (a restarted instance of the same configuration starts promoted); to make it permanent set `policy` of [interfaces.{name}] to the rollout's policy (\"{policy}\" with its parameters), remove `rollout`, and start on a new state.namespace (or with --reset-state): the namespace checks the configured policy")
    } else {
        format!("promoted: the state file keeps the promotion across restarts; set `policy` of [interfaces.{name}] to the rollout's policy (\"{policy}\" with its parameters) and remove `rollout` to make it permanent (without a state file a restart runs the old policy again)")
    };
    Ok(Json(json!({
        "interface": name,
        "status": "promoted",
        "live_policy": policy,
        "note": note,
    })))
}

/// `POST /v1/interfaces/{name}/rollout/abort`.
pub(super) async fn abort(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let iface = interface(&state, &name)?;
    rollout_of(&iface, &name)?;
    end_by_operator(&state, &iface, false)?;
    let note = if state.shared.is_some() {
        format!("every request goes to the live policy again, here and on every instance sharing the state through Redis within a sync interval (a restarted instance starts with the rollout ended); remove `rollout` from [interfaces.{name}]")
    } else {
        format!("every request goes to the live policy again; the state file keeps the rollout ended across restarts; remove `rollout` from [interfaces.{name}] (without a state file a restart starts the canary again)")
    };
    Ok(Json(json!({
        "interface": name,
        "status": "aborted",
        "live_policy": iface.policy_name(),
        "note": note,
    })))
}

impl AppState {
    /// Ends `iface`'s rollout by an operator's decision ([`end_by_operator`]).
    ///
    /// # Errors
    /// No rollout, or one not running (409 `rollout_not_running`), or a poisoned lock.
    pub fn end_rollout_by_operator(
        &self,
        iface: &InterfaceRuntime,
        promote: bool,
    ) -> Result<(), ApiError> {
        end_by_operator(self, iface, promote)
    }
}

/// Ends `iface`'s rollout by an operator's decision: `promote` swaps the live policy for
/// the candidate (its configuration and learnt state), else the canary is aborted; with
/// state shared through Redis the end reaches every instance.
///
/// # Errors
/// No rollout, or one not running (409 `rollout_not_running`), or a poisoned lock.
fn end_by_operator(
    state: &AppState,
    iface: &InterfaceRuntime,
    promote: bool,
) -> Result<(), ApiError> {
    let Some(rollout) = &iface.arms.rollout else {
        return Err(ApiError::not_found(
            "no_rollout",
            format!("interface `{}` has no rollout", iface.name),
        ));
    };
    let not_running =
        |why| ApiError::invalid(axum::http::StatusCode::CONFLICT, "rollout_not_running", why);
    let ledger = state.ledger(iface);
    if !promote {
        let end = rollout
            .end(&iface.name, false, state.now().0)
            .map_err(not_running)?;
        ledger.journal_rollout_end(end);
        return Ok(());
    }
    let candidate = rollout.policy.write()?.clone_box();
    let end = rollout
        .end(&iface.name, true, state.now().0)
        .map_err(not_running)?;
    {
        let mut live = ledger.policy_mut()?;
        *live = candidate;
        // Journaled under the live policy's lock: the observations journaled after it
        // are the promoted policy's (the order the shared stream replays them in).
        ledger.journal_rollout_end(end);
    }
    iface.arms.set_live(rollout.policy.kind);
    Ok(())
}
