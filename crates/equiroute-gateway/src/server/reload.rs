//! Reloading the configuration without a restart (`SIGHUP`, `POST /v1/admin/reload`): the
//! configuration is read again from where the gateway started it and validated first (a bad
//! one is refused, the running one kept), every new interface runtime is built, then the
//! interfaces are swapped in one atomic store. Requests in flight finish on the runtimes they
//! started with.
//!
//! What each interface keeps (docs/operations.md, "Reloading the configuration"):
//! - unchanged (its whole table equal): its runtime as it is (policy, breakers, history);
//! - changed, with the same providers (ids, in order) and a policy that takes the old one's
//!   state (the same kind): a new runtime holding the old one's policy statistics, side
//!   policies (shadow, rollout) and breakers, as a restart with the state file would (a live
//!   policy built from the same table is copied exactly);
//! - changed otherwise: a new runtime, its policy from priors; the breakers and first-byte
//!   times of the providers it keeps (by id) are carried over;
//! - added: from priors; removed: dropped.
//!
//! Settings set up once at start (listener, keys, limits, logs, `[state]`, `[audit]`,
//! `[telemetry]`) refuse the reload ("restart needed for …"); with Redis, so does any change of
//! the namespace's shape (interfaces, provider ids, policies, feature sizes).

use super::error::ApiError;
use super::learnt::InterfaceSnapshot;
use super::state::{AppState, InterfaceRuntime, Interfaces};
use crate::config::{GatewayConfig, InterfaceConfig};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Serialize;
use std::sync::Arc;

/// An applied reload: the new version and what changed.
#[derive(Clone, Debug, Serialize)]
pub struct Reloaded {
    /// The configuration's version now (1 at start, one more at each applied reload).
    pub version: u64,
    /// When it was loaded (wall clock, milliseconds since the Unix epoch).
    pub loaded_unix_ms: f64,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<Changed>,
    pub unchanged: Vec<String>,
}

impl Reloaded {
    /// Whether the reload changed any interface.
    #[must_use]
    pub fn changed_anything(&self) -> bool {
        !(self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty())
    }
}

/// An interface the reload rebuilt, and what its new runtime kept of the old one's learning.
#[derive(Clone, Debug, Serialize)]
pub struct Changed {
    pub interface: String,
    /// `all`: the policy's statistics, the side policies and the breakers (same providers,
    /// same kind of policy); `by_provider`: the breakers and first-byte times of the providers
    /// kept, the policy from priors.
    pub learnt: &'static str,
    pub providers_added: Vec<String>,
    pub providers_removed: Vec<String>,
}

/// A refused reload: the running configuration keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("this gateway was given its configuration in memory, not from a file: there is nothing to read again")]
    NoSource,
    /// The file cannot be read, or does not validate (the file, the field and the fix).
    #[error("{0}; the running configuration is kept")]
    Invalid(String),
    #[error("restart needed for {}: a running gateway sets it up once, at start; the running configuration is kept. Restart to apply the file, or undo that change to reload the rest", .0.join(", "))]
    RestartNeeded(Vec<&'static str>),
    /// With Redis, a change of the namespace's shape.
    #[error("restart needed: {0} (the Redis namespace records the interfaces, their provider ids, policies and feature sizes, and every instance must share them); the running configuration is kept. Change them on every instance with a restart, on a new `[state] namespace` or after `equiroute serve --reset-state`")]
    SharedShape(String),
    #[error("interface `{interface}`: {reason}; the running configuration is kept")]
    Build { interface: String, reason: String },
    #[error("the gateway's state is unavailable after a crash in another request: restart it")]
    Poisoned,
    #[error("the gateway has stopped")]
    Stopped,
}

impl ReloadError {
    /// The `code` of the route's error body.
    #[must_use]
    pub fn code(&self) -> &'static str {
        match self {
            ReloadError::NoSource => "reload_unavailable",
            ReloadError::Invalid(_) | ReloadError::Build { .. } => "invalid_configuration",
            ReloadError::RestartNeeded(_) | ReloadError::SharedShape(_) => "restart_needed",
            ReloadError::Poisoned | ReloadError::Stopped => "internal_error",
        }
    }
}

impl From<ReloadError> for ApiError {
    fn from(e: ReloadError) -> ApiError {
        match e {
            ReloadError::Poisoned | ReloadError::Stopped => ApiError::internal(),
            ReloadError::NoSource => {
                ApiError::invalid(StatusCode::CONFLICT, e.code(), e.to_string())
            }
            e => ApiError::bad_request(e.code(), None, e.to_string()),
        }
    }
}

/// Reads the configuration again from the gateway's source and applies it ([`apply`]);
/// logged (`info` with what changed, `warn` with why it was refused) and counted in
/// `/metrics`. The one entry of `SIGHUP` and of the admin route.
///
/// # Errors
/// Why the reload was refused; the running configuration keeps serving.
pub async fn reload(state: &AppState) -> Result<Reloaded, ReloadError> {
    let read = match state.source.get().cloned() {
        None => Err(ReloadError::NoSource),
        // The file is read off the event loop.
        Some(source) => tokio::task::spawn_blocking(move || source.read())
            .await
            .map_err(|e| ReloadError::Invalid(format!("the reading thread failed ({e})")))
            .and_then(|read| read.map_err(ReloadError::Invalid)),
    };
    let result = read.and_then(|next| {
        // Fields accepted with no effect, as `serve` warns of them at start.
        for w in &next.warnings {
            tracing::warn!("{w}");
        }
        apply(state, next)
    });
    match &result {
        Ok(r) => {
            state.metrics.config_reload("applied");
            tracing::info!(
                version = r.version,
                added = ?r.added,
                removed = ?r.removed,
                changed = ?r.changed.iter().map(|c| format!("{} (learnt: {})", c.interface, c.learnt)).collect::<Vec<_>>(),
                unchanged = r.unchanged.len(),
                "configuration reloaded"
            );
        }
        Err(e) => {
            state.metrics.config_reload("refused");
            tracing::warn!(error = %e, "configuration reload refused");
        }
    }
    result
}

/// `POST /v1/admin/reload`: reads the configuration file the gateway started with (never a
/// path or a text from the client) and applies it; answers what changed, or the refusal.
pub(super) async fn route(
    State(state): State<Arc<AppState>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let done = reload(&state).await?;
    let mut body = serde_json::to_value(&done).map_err(|_| ApiError::internal())?;
    body["status"] = "applied".into();
    Ok(Json(body))
}

/// Swaps the interfaces of `state` for those of `next` once all of them are built, or
/// refuses `next` with the running configuration untouched.
///
/// # Errors
/// A setting that needs a restart, a change Redis cannot follow, or an interface that
/// cannot be built.
pub fn apply(state: &AppState, next: GatewayConfig) -> Result<Reloaded, ReloadError> {
    // Held to the end: reloads apply one at a time.
    let mut configured = state.configured.lock().map_err(|_| ReloadError::Poisoned)?;
    let restart = configured.config.restart_needed(&next);
    if !restart.is_empty() {
        return Err(ReloadError::RestartNeeded(restart));
    }
    if state.shared.is_some() {
        same_shape(&configured.config, &next).map_err(ReloadError::SharedShape)?;
    }
    // The new upstreams share the connection pool; a new secret gets a redactor that knows it.
    let wiring = if next.secret_values() == configured.config.secret_values() {
        state.wiring.clone()
    } else {
        crate::upstream::http::Wiring {
            client: state.wiring.client.clone(),
            redactor: Arc::new(crate::redact::Redactor::new(next.secret_values())),
        }
    };
    let current = state.interfaces();
    let mut built = Interfaces::new();
    let mut report = Reloaded {
        version: configured.version + 1,
        loaded_unix_ms: state.now().0,
        added: Vec::new(),
        removed: Vec::new(),
        changed: Vec::new(),
        unchanged: Vec::new(),
    };
    let mut replaced = Vec::new();
    for cfg in &next.interfaces {
        let before = configured
            .config
            .interfaces
            .iter()
            .find(|i| i.name == cfg.name);
        let runtime = match (before, current.get(&cfg.name)) {
            (Some(before), Some(old)) if before == cfg => {
                report.unchanged.push(cfg.name.clone());
                old.clone()
            }
            (Some(before), Some(old)) => {
                let (new, changed) = rebuild(state, before, cfg, old, &wiring)?;
                report.changed.push(changed);
                replaced.push((old.clone(), new.clone()));
                new
            }
            _ => {
                report.added.push(cfg.name.clone());
                Arc::new(fresh(cfg, &wiring, &state.key_rows, &state.metrics)?)
            }
        };
        built.insert(cfg.name.clone(), runtime);
    }
    for (name, old) in current.iter() {
        if !built.contains_key(name) {
            report.removed.push(name.clone());
            old.retire();
        }
    }
    drop(current);
    state.swap_interfaces(built);
    for (old, new) in &replaced {
        old.retire();
        retarget_pending(state, old, new);
    }
    state.metrics.start_at_zero(&next);
    state
        .metrics
        .config_loaded(report.version, report.loaded_unix_ms);
    configured.config = next;
    configured.version = report.version;
    configured.loaded_unix_ms = report.loaded_unix_ms;
    Ok(report)
}

/// A runtime of `cfg` from priors.
fn fresh(
    cfg: &InterfaceConfig,
    wiring: &crate::upstream::http::Wiring,
    keys: &[super::ops::KeyRow],
    metrics: &super::metrics::Metrics,
) -> Result<InterfaceRuntime, ReloadError> {
    InterfaceRuntime::new(cfg, wiring, keys, metrics).map_err(|e| ReloadError::Build {
        interface: cfg.name.clone(),
        reason: e.to_string(),
    })
}

/// The new runtime of the changed interface `cfg` (`before` the reload), with what it keeps
/// of `old`'s learning.
fn rebuild(
    state: &AppState,
    before: &InterfaceConfig,
    cfg: &InterfaceConfig,
    old: &Arc<InterfaceRuntime>,
    wiring: &crate::upstream::http::Wiring,
) -> Result<(Arc<InterfaceRuntime>, Changed), ReloadError> {
    let saved = InterfaceSnapshot::of(state, old).ok_or(ReloadError::Poisoned)?;
    let mut new = fresh(cfg, wiring, &state.key_rows, &state.metrics)?;
    let learnt = if saved.restore(&cfg.name, &new).is_ok() {
        // A live policy built from the same table is the old one, copied exactly (a merge
        // into priors may round a mean by an ulp).
        let same_policy = before.policy == cfg.policy
            && before.exploration_floor == cfg.exploration_floor
            && before.feature_dim == cfg.feature_dim
            && before.rollout == cfg.rollout;
        if same_policy {
            let copy = state
                .policy_mut(old)
                .map_err(|_| ReloadError::Poisoned)?
                .clone_box();
            *new.policy.write().map_err(|_| ReloadError::Poisoned)? = copy;
        }
        "all"
    } else {
        // Another set of providers or another policy: what the restore left is dropped.
        new = fresh(cfg, wiring, &state.key_rows, &state.metrics)?;
        carry_breakers(old, &new);
        "by_provider"
    };
    carry_latency_times(old, &new);
    carry_capacity(old, &mut new);
    carry_minutes(state, old, &new);
    let ids = |i: &InterfaceRuntime| -> Vec<String> {
        i.candidates.iter().map(|c| c.id.0.clone()).collect()
    };
    let (before, after) = (ids(old), ids(&new));
    let changed = Changed {
        interface: cfg.name.clone(),
        learnt,
        providers_added: after
            .iter()
            .filter(|p| !before.contains(p))
            .cloned()
            .collect(),
        providers_removed: before
            .iter()
            .filter(|p| !after.contains(p))
            .cloned()
            .collect(),
    };
    Ok((Arc::new(new), changed))
}

/// For each candidate of `new`, the index of the provider of the same id in `old`.
fn same_provider(old: &InterfaceRuntime, new: &InterfaceRuntime) -> Vec<Option<usize>> {
    new.candidates
        .iter()
        .map(|c| old.index_of(&c.id.0))
        .collect()
}

/// Copies each per-provider value `field` of `old` to the provider of the same id in `new`.
fn carry_by_id<T: Clone>(
    old: &InterfaceRuntime,
    new: &InterfaceRuntime,
    field: impl Fn(&InterfaceRuntime) -> &std::sync::Mutex<Vec<T>>,
) {
    let (Ok(from), Ok(mut to)) = (field(old).lock(), field(new).lock()) else {
        return;
    };
    for (j, i) in same_provider(old, new).into_iter().enumerate() {
        if let (Some(value), Some(slot)) = (i.and_then(|i| from.get(i)), to.get_mut(j)) {
            slot.clone_from(value);
        }
    }
}

/// The breakers of the providers `new` keeps, copied from `old`.
fn carry_breakers(old: &InterfaceRuntime, new: &InterfaceRuntime) {
    carry_by_id(old, new, |i| &i.breakers);
}

/// The first-byte and answer times of the providers `new` keeps, copied from `old`.
fn carry_latency_times(old: &InterfaceRuntime, new: &InterfaceRuntime) {
    carry_by_id(old, new, |i| &i.first_bytes);
    carry_by_id(old, new, |i| &i.answer_times);
}

/// The capacity of the providers `new` keeps: the same counts (what the last 60 s used, what
/// the headers said is left, the requests in flight) when the provider's caps are unchanged,
/// else the counts carried to the new caps (the requests in flight then count on the old
/// ones until they end).
fn carry_capacity(old: &InterfaceRuntime, new: &mut InterfaceRuntime) {
    for (i, at) in same_provider(old, new).into_iter().enumerate() {
        if let Some(o) = at {
            let before = &old.capacity[o];
            new.capacity[i] = if before.caps == new.capacity[i].caps {
                before.clone()
            } else {
                before.carried(new.capacity[i].caps)
            };
        }
    }
}

/// The operations view's minute ring of the providers `new` keeps, copied from `old` (the
/// 24-hour view goes on across the reload).
fn carry_minutes(state: &AppState, old: &InterfaceRuntime, new: &InterfaceRuntime) {
    let ids = |i: &InterfaceRuntime| -> Vec<String> {
        i.candidates.iter().map(|c| c.id.0.clone()).collect()
    };
    if let Some(ring) = old.history.save_minutes(state.now(), &ids(old)) {
        let _ = new.history.restore_minutes(&ring, &ids(new));
    }
}

/// Moves the contexts kept for feedback on `old` to `new`'s indices: a provider `new` lacks,
/// or features of another size, and the context's score teaches nothing.
fn retarget_pending(state: &AppState, old: &InterfaceRuntime, new: &InterfaceRuntime) {
    let same_features = old.featurizer.dim() == new.featurizer.dim();
    let to: Vec<Option<usize>> = old
        .candidates
        .iter()
        .map(|c| new.index_of(&c.id.0).filter(|_| same_features))
        .collect();
    if to.iter().enumerate().all(|(i, j)| *j == Some(i)) {
        return;
    }
    if let Ok(mut pending) = state.pending.lock() {
        pending.retarget(&old.name, &|i| to.get(i).copied().flatten());
    }
}

/// With Redis: `next` keeps the namespace's shape (the same interfaces, each with the same
/// provider ids, policies and feature sizes), or why not.
fn same_shape(running: &GatewayConfig, next: &GatewayConfig) -> Result<(), String> {
    let names = |c: &GatewayConfig| -> Vec<String> {
        c.interfaces.iter().map(|i| i.name.clone()).collect()
    };
    if names(running) != names(next) {
        return Err(format!(
            "the interfaces would change from {:?} to {:?}",
            names(running),
            names(next)
        ));
    }
    for (a, b) in running.interfaces.iter().zip(&next.interfaces) {
        let ids = |i: &InterfaceConfig| -> Vec<String> {
            i.providers
                .iter()
                .map(|p| p.candidate.id.0.clone())
                .collect()
        };
        let differs = [
            ("its provider ids", ids(a) != ids(b)),
            ("its policy", a.policy != b.policy),
            (
                "its exploration floor",
                a.exploration_floor != b.exploration_floor,
            ),
            ("its shadow", a.shadow != b.shadow),
            ("its rollout", a.rollout != b.rollout),
            ("feature_dim", a.feature_dim != b.feature_dim),
            (
                "feature_max_words",
                a.feature_max_words != b.feature_max_words,
            ),
        ];
        if let Some((what, _)) = differs.iter().find(|(_, d)| *d) {
            return Err(format!("interface `{}`: {what} would change", a.name));
        }
    }
    Ok(())
}
