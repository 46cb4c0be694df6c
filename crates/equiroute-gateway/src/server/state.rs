//! Shared state of a running gateway: the interfaces with their policies and breakers, the
//! contexts of answered requests waiting for quality feedback, and the metrics.
//!
//! Locks are held only around pure, microsecond-scale core calls (rank, observe, breaker
//! bookkeeping) and never across an `.await`.

use super::metrics::Metrics;
use crate::config::{GatewayConfig, InterfaceConfig, InterfaceKind};
pub use crate::pending::{Features, PendingContext, PendingFeedback, PendingStore};
use crate::shared::Event;
use crate::upstream::Upstream;
use equiroute_core::breaker::{Breaker, BreakerConfig};
use equiroute_core::breaker::{BreakerState, Transition};
use equiroute_core::executor::ExecutionLimits;
use equiroute_core::features::Featurizer;
use equiroute_core::policies::{AttemptObservation, Observation, Policy, QualityObservation};
use equiroute_core::{AttemptOutcome, Candidate, Millis, SlicePath, Timestamp};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockWriteGuard};
use std::time::Instant;

/// One interface at run time.
#[derive(Debug)]
pub struct InterfaceRuntime {
    pub name: String,
    pub kind: InterfaceKind,
    pub candidates: Vec<Candidate>,
    pub upstreams: Vec<Upstream>,
    pub featurizer: Featurizer,
    pub deadline: Option<Millis>,
    pub limits: ExecutionLimits,
    /// Hedged requests and their budget (a token bucket shared by the interface's requests).
    pub hedge: equiroute_core::hedge::HedgeConfig,
    pub hedge_budget: Mutex<equiroute_core::hedge::HedgeBudget>,
    /// Longest silence between two chunks of a relayed stream.
    pub stream_idle: Millis,
    /// How much of a stream is held before anything is sent to the client.
    pub stream_hold: crate::config::first_byte::StreamHold,
    /// How a stream that broke after it was committed goes on.
    pub stream_resume: crate::config::first_byte::StreamResume,
    /// Per candidate: the provider continues a final assistant message (`assistant_prefill`).
    pub prefill: Vec<bool>,
    /// How a streamed attempt's first-byte limit is derived from `first_bytes`.
    pub first_byte: super::ttfb::FirstByteLimit,
    /// Each candidate's first-byte times (streamed attempts), for its first-byte limit.
    pub first_bytes: Mutex<Vec<equiroute_core::estimators::nig::LogLatencyStats>>,
    /// The LLM-as-judge, when configured.
    pub judge: Option<Arc<crate::feedback::judge::Judge>>,
    /// Ranks take the read side (they run in parallel); observations the write side. The
    /// request path only tries the write side: see `deferred`.
    pub policy: RwLock<Box<dyn Policy>>,
    /// Attempt observations that found the policy locked: queued here instead of waiting (a
    /// ranking thread descheduled while it holds the read side would otherwise stall every
    /// request behind it), applied and journaled, in order, by the next holder of the write
    /// side (`AppState::policy_mut`, or the next attempt that gets it).
    deferred: Mutex<Vec<Observation>>,
    /// `deferred.len()`, readable without the lock (updated under it).
    deferred_len: AtomicUsize,
    pub breakers: Mutex<Vec<Breaker>>,
    pub breaker_config: BreakerConfig,
    /// How often each candidate was the first choice.
    pub first_choices: Vec<AtomicU64>,
    /// The shadow policy and the canary rollout, when configured (see [`super::arms`]).
    pub arms: super::arms::Arms,
    /// The task classes learnt in slices of their own (`task_classes`); `None`: any.
    pub task_classes: Option<Vec<String>>,
    /// Recent traffic, for the dashboard (fixed size).
    pub history: super::dashboard::History,
}

impl InterfaceRuntime {
    fn new(
        cfg: &InterfaceConfig,
        wiring: &crate::upstream::http::Wiring,
    ) -> Result<InterfaceRuntime, equiroute_core::ConfigError> {
        let candidates: Vec<Candidate> =
            cfg.providers.iter().map(|p| p.candidate.clone()).collect();
        let policy =
            cfg.policy
                .build_with_floor(&candidates, cfg.feature_dim, &cfg.exploration_floor)?;
        Ok(InterfaceRuntime {
            name: cfg.name.clone(),
            kind: cfg.kind,
            upstreams: cfg
                .providers
                .iter()
                .map(|p| {
                    Upstream::new(
                        &p.candidate.id.0,
                        p.candidate.tier,
                        &p.upstream,
                        &wiring.client,
                        &wiring.redactor,
                    )
                    .with_unsupported_params(p.unsupported_params)
                })
                .collect(),
            featurizer: Featurizer::new(cfg.feature_dim)?.with_max_words(cfg.feature_max_words)?,
            deadline: cfg.deadline,
            limits: cfg.limits,
            hedge: cfg.hedge,
            hedge_budget: Mutex::new(equiroute_core::hedge::HedgeBudget::new(&cfg.hedge)),
            stream_idle: cfg.stream_idle,
            stream_hold: cfg.stream_hold,
            stream_resume: cfg.stream_resume,
            prefill: cfg.providers.iter().map(|p| p.assistant_prefill).collect(),
            first_byte: cfg.first_byte,
            first_bytes: Mutex::new(vec![
                equiroute_core::estimators::nig::LogLatencyStats::default();
                candidates.len()
            ]),
            judge: cfg
                .judge
                .as_ref()
                .map(|j| Arc::new(crate::feedback::judge::Judge::new(j, wiring.clone()))),
            arms: super::arms::Arms::new(cfg)?,
            policy: RwLock::new(policy),
            deferred: Mutex::new(Vec::new()),
            deferred_len: AtomicUsize::new(0),
            breakers: Mutex::new(vec![Breaker::default(); candidates.len()]),
            breaker_config: cfg.breaker,
            first_choices: candidates.iter().map(|_| AtomicU64::new(0)).collect(),
            task_classes: cfg.task_classes.clone(),
            history: super::dashboard::History::new(candidates.len()),
            candidates,
        })
    }

    /// The live policy's name (a promoted canary's once promoted).
    #[must_use]
    pub fn policy_name(&self) -> &'static str {
        self.arms.live_name()
    }

    /// The index of the candidate called `id`.
    #[must_use]
    pub fn index_of(&self, id: &str) -> Option<usize> {
        self.candidates.iter().position(|c| c.id.0 == id)
    }
}

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    pub interfaces: BTreeMap<String, Arc<InterfaceRuntime>>,
    pub pending: Mutex<PendingStore>,
    pub metrics: Metrics,
    /// The configured keys, what each may do, and each one's feedback rate.
    pub keys: super::auth::Keys,
    /// Every secret of the configuration and the credential shapes: what any text of an
    /// upstream's passes through before a client, a log line, a span or the audit log sees it.
    pub redactor: Arc<crate::redact::Redactor>,
    /// The rate limits of the log lines a client can trigger at will.
    pub logs: super::repeated::RepeatedLogs,
    /// The decision audit log, when configured.
    pub audit: Option<super::audit::AuditLog>,
    pub feedback_ttl: Millis,
    /// The journal and sync status when learning state is shared through Redis.
    pub shared: Option<crate::shared::SharedHandle>,
    epoch: Instant,
    /// Wall-clock time at `epoch`; `now()` advances monotonically from it.
    started_unix_ms: f64,
    requests: AtomicU64,
    seed: u64,
    /// A full state dump is being built (`?full=true`: one at a time).
    pub full_dump_busy: std::sync::atomic::AtomicBool,
}

impl AppState {
    /// The state of a gateway configured by `cfg`; `seed` seeds every random choice.
    ///
    /// # Errors
    /// A policy or featurizer that cannot be built (already checked by config loading).
    pub fn new(cfg: &GatewayConfig, seed: u64) -> Result<AppState, equiroute_core::ConfigError> {
        // One connection pool and one redactor for every HTTP upstream.
        let wiring = crate::upstream::http::Wiring {
            client: crate::upstream::client::HttpClient::new(),
            redactor: Arc::new(crate::redact::Redactor::new(cfg.secret_values())),
        };
        let mut interfaces = BTreeMap::new();
        for i in &cfg.interfaces {
            interfaces.insert(i.name.clone(), Arc::new(InterfaceRuntime::new(i, &wiring)?));
        }
        let metrics = Metrics::default();
        let keys = super::auth::Keys::new(
            &cfg.keys,
            cfg.feedback_rate,
            cfg.connections.max_in_flight_per_key,
        )
        .counted(metrics.refusals("too_many_requests_in_flight"));
        Ok(AppState {
            interfaces,
            pending: Mutex::new(PendingStore::new(cfg.max_pending_feedback)),
            logs: super::repeated::RepeatedLogs::new(&metrics),
            metrics,
            keys,
            redactor: wiring.redactor,
            audit: None,
            feedback_ttl: cfg.feedback_ttl,
            shared: match &cfg.state {
                Some(crate::config::StateConfig::Redis(r)) => {
                    Some(crate::shared::SharedHandle::new(r))
                }
                _ => None,
            },
            epoch: Instant::now(),
            started_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64() * 1000.0),
            requests: AtomicU64::new(0),
            seed,
            full_dump_busy: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Wall-clock milliseconds since the Unix epoch: the clock the core sees. Wall time (not
    /// time since start) so that learning state saved by one run still decays correctly in
    /// the next.
    #[must_use]
    pub fn now(&self) -> Timestamp {
        let since_start = self.epoch.elapsed().as_secs_f64() * 1000.0;
        Timestamp(self.started_unix_ms + since_start)
    }

    /// Wall-clock milliseconds since the Unix epoch when this gateway started: the start of
    /// the window of its in-memory counters (first choices, metrics).
    #[must_use]
    pub fn started_unix_ms(&self) -> f64 {
        self.started_unix_ms
    }

    /// A new request number and id. The number seeds the request's random choices
    /// ([`AppState::seed_for`], reproducible from the gateway's seed); the id is 128 bits from
    /// a CSPRNG (`rand`'s thread generator: `ChaCha12`, seeded and reseeded from the OS), so that
    /// no caller can guess another's id from its own.
    pub fn next_request(&self) -> (u64, String) {
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        let id: u128 = rand::Rng::random(&mut rand::rng());
        (n, format!("req-{id:032x}"))
    }

    /// A seed for request number `n`'s random choices.
    #[must_use]
    pub fn seed_for(&self, n: u64) -> u64 {
        self.seed ^ n.wrapping_mul(0xbf58_476d_1ce4_e5b9)
    }

    /// Drops contexts older than twice the feedback TTL (expired ones are kept for one more
    /// TTL so that late feedback gets a clear 410 rather than a 404).
    pub fn prune_pending(&self, now: Timestamp) {
        if let Ok(mut p) = self.pending.lock() {
            p.prune(now, 2.0 * self.feedback_ttl.0);
        }
    }
}

/// A poisoned lock: a handler panicked while holding it.
#[derive(Debug, Clone, Copy)]
pub struct Poisoned;

/// The metric label of a breaker transition.
#[must_use]
pub fn transition_name(t: Transition) -> &'static str {
    match t {
        Transition::Opened => "open",
        Transition::HalfOpened => "half_open",
        Transition::Closed => "closed",
    }
}

impl AppState {
    /// The policy's write side, with the observations deferred while it was busy applied
    /// (and journaled) first: every reader of the whole state and every other writer goes
    /// through here.
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn policy_mut<'a>(
        &self,
        iface: &'a InterfaceRuntime,
    ) -> Result<RwLockWriteGuard<'a, Box<dyn Policy>>, Poisoned> {
        let mut policy = iface.policy.write().map_err(|_| Poisoned)?;
        self.apply_deferred(iface, policy.as_mut());
        Ok(policy)
    }

    /// Applies and journals the deferred observations, oldest first; the caller holds the
    /// write side.
    fn apply_deferred(&self, iface: &InterfaceRuntime, policy: &mut dyn Policy) {
        if iface.deferred_len.load(Ordering::Acquire) == 0 {
            return;
        }
        let batch = match iface.deferred.lock() {
            Ok(mut queue) => {
                iface.deferred_len.store(0, Ordering::Release);
                std::mem::take(&mut *queue)
            }
            Err(_) => return,
        };
        for obs in batch {
            self.learn(iface, policy, obs);
        }
    }

    /// Applies `obs` and journals it, and reports the quality shifts it set off; the caller
    /// holds the write side.
    fn learn(&self, iface: &InterfaceRuntime, policy: &mut dyn Policy, obs: Observation) {
        obs.apply(policy);
        self.journal_learn(iface, || obs);
        super::shifts::report(self, iface, policy);
    }

    /// Journals an observation the policy has just learnt (built only when a journal exists).
    fn journal_learn(&self, iface: &InterfaceRuntime, obs: impl FnOnce() -> Observation) {
        self.journal(|| Event::Learn {
            iface: iface.name.clone(),
            obs: obs(),
        });
    }

    fn journal(&self, event: impl FnOnce() -> Event) {
        if let Some(shared) = &self.shared {
            shared.journal.record(event());
        }
    }

    /// Journals the end of `iface`'s rollout decided here, so that the other instances end
    /// theirs (state shared through Redis).
    pub fn journal_rollout_end(&self, iface: &InterfaceRuntime, end: crate::shared::RolloutEnd) {
        self.journal(|| Event::RolloutEnd {
            iface: iface.name.clone(),
            end,
        });
    }

    /// Ends `iface`'s rollout by an operator's decision: `promote` swaps the live policy for
    /// the candidate (its configuration and learnt state), else the canary is aborted; with
    /// state shared through Redis the end reaches every instance.
    ///
    /// # Errors
    /// No rollout, or one not running (409 `rollout_not_running`), or a poisoned lock.
    pub fn end_rollout_by_operator(
        &self,
        iface: &InterfaceRuntime,
        promote: bool,
    ) -> Result<(), super::error::ApiError> {
        use super::error::ApiError;
        let Some(rollout) = &iface.arms.rollout else {
            return Err(ApiError::not_found(
                "no_rollout",
                format!("interface `{}` has no rollout", iface.name),
            ));
        };
        let not_running =
            |why| ApiError::invalid(axum::http::StatusCode::CONFLICT, "rollout_not_running", why);
        if !promote {
            let end = rollout
                .end(&iface.name, false, self.now().0)
                .map_err(not_running)?;
            self.journal_rollout_end(iface, end);
            return Ok(());
        }
        let candidate = rollout.policy.write()?.clone_box();
        let end = rollout
            .end(&iface.name, true, self.now().0)
            .map_err(not_running)?;
        {
            let mut live = self.policy_mut(iface)?;
            *live = candidate;
            // Journaled under the live policy's lock: the observations journaled after it
            // are the promoted policy's (the order the shared stream replays them in).
            self.journal_rollout_end(iface, end);
        }
        iface.arms.set_live(rollout.policy.kind);
        Ok(())
    }

    /// Books the end of request `request_id` with its arms ([`super::arms::finish`]), and
    /// shares the rollback its outcome set off, if it did.
    pub fn finish_routed(
        &self,
        iface: &InterfaceRuntime,
        request_id: &str,
        routed: super::arms::Routed,
        status: equiroute_core::executor::RequestStatus,
    ) {
        if let Some(end) = super::arms::finish(iface, request_id, routed, status, self.now().0) {
            self.journal_rollout_end(iface, end);
        }
    }

    /// Feeds one finished attempt (ending now) to the policy, the breaker and the metrics,
    /// and to the shared journal when state is shared.
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn record_attempt(
        &self,
        iface: &InterfaceRuntime,
        index: usize,
        features: &[f64],
        slice: SlicePath,
        outcome: &AttemptOutcome,
        remaining: Option<Millis>,
    ) -> Result<(), Poisoned> {
        let arm = super::arms::Arm::Live;
        self.record_routed_attempt(iface, arm, index, features, slice, outcome, remaining)
    }

    /// [`AppState::record_attempt`] of a request routed by `arm`: a canary's attempts teach
    /// the candidate policy instead of the live one (see [`super::arms`]).
    ///
    /// # Errors
    /// A poisoned lock.
    #[allow(clippy::too_many_arguments)]
    pub fn record_routed_attempt(
        &self,
        iface: &InterfaceRuntime,
        arm: super::arms::Arm,
        index: usize,
        features: &[f64],
        slice: SlicePath,
        outcome: &AttemptOutcome,
        remaining: Option<Millis>,
    ) -> Result<(), Poisoned> {
        let end = self.now();
        let id = &iface.candidates[index].id.0;
        self.metrics
            .attempt(&iface.name, id, outcome.status.as_str());
        self.metrics.provider_cost(&iface.name, id, outcome.cost.0);
        let obs = AttemptObservation {
            candidate: index,
            features,
            slice,
            deadline: remaining,
            outcome,
            now: end,
        };
        // The journal is written under the policy lock: the sync task rebuilds the live
        // policy under the same lock (see `shared`). When the lock is busy the observation
        // waits in `deferred` rather than the request waiting for the lock. A canary's
        // attempts teach its own policy only.
        let live = super::arms::observe_attempt(iface, arm, &obs);
        if !live {
            // The rollout's candidate learnt it: the other instances' candidates learn it too.
            self.journal(|| Event::RolloutLearn {
                iface: iface.name.clone(),
                obs: Observation::attempt(&obs),
            });
        }
        if live {
            match iface.policy.try_write() {
                Ok(mut policy) => {
                    self.apply_deferred(iface, policy.as_mut());
                    policy.observe_attempt(&obs);
                    self.journal_learn(iface, || Observation::attempt(&obs));
                    let evicted = policy.take_slice_evictions();
                    if evicted > 0 {
                        self.metrics.slices_evicted(&iface.name, evicted);
                    }
                    super::shifts::report(self, iface, policy.as_mut());
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    let mut queue = iface.deferred.lock().map_err(|_| Poisoned)?;
                    queue.push(Observation::attempt(&obs));
                    iface.deferred_len.store(queue.len(), Ordering::Release);
                }
                Err(std::sync::TryLockError::Poisoned(_)) => return Err(Poisoned),
            }
        }
        self.move_breaker(iface, index, end, |breaker, cfg| {
            breaker.observe(end, outcome, cfg)
        })?;
        Ok(())
    }

    /// Counts a failure against candidate `index`'s breaker that no attempt of its own
    /// showed: a rejection another provider disputed (see `server::rejections`). Returns
    /// the open period's end when this failure opened (or re-opened) the breaker.
    ///
    /// # Errors
    /// A poisoned lock.
    pub(crate) fn count_failure(
        &self,
        iface: &InterfaceRuntime,
        index: usize,
    ) -> Result<Option<Timestamp>, Poisoned> {
        let end = self.now();
        self.move_breaker(iface, index, end, |breaker, cfg| {
            [
                breaker.record(end, equiroute_core::breaker::BreakerOutcome::Failure, cfg),
                None,
            ]
        })
    }

    /// Applies `change` (at `end`) to candidate `index`'s breaker, counts its transitions,
    /// shares an opening with the other instances and tells the policy of a recovery.
    /// Returns the open period's end when it opened.
    fn move_breaker(
        &self,
        iface: &InterfaceRuntime,
        index: usize,
        end: Timestamp,
        change: impl FnOnce(&mut Breaker, &BreakerConfig) -> [Option<Transition>; 2],
    ) -> Result<Option<Timestamp>, Poisoned> {
        let id = &iface.candidates[index].id.0;
        let mut breakers = iface.breakers.lock().map_err(|_| Poisoned)?;
        let before = breakers[index].state;
        let mut recovered = false;
        for t in change(&mut breakers[index], &iface.breaker_config)
            .into_iter()
            .flatten()
        {
            self.metrics.breaker(id, transition_name(t));
            // Closed by an attempt: its half-open probes succeeded.
            recovered |= t == Transition::Closed;
        }
        let state = breakers[index].state;
        let pinned = breakers[index].is_pinned();
        drop(breakers);
        if recovered {
            // A detected change: the failures from before the recovery no longer count.
            self.observe(
                iface,
                Observation::Recovered {
                    candidate: index,
                    now: end,
                },
            )?;
        }
        let BreakerState::Open { until } = state else {
            return Ok(None);
        };
        if state == before {
            return Ok(None);
        }
        self.journal(|| Event::BreakerOpen {
            iface: iface.name.clone(),
            candidate: index,
            until,
            pinned,
        });
        Ok(Some(until))
    }

    /// Feeds an observation to the interface's policy (and the shared journal): the entry
    /// point for observations made elsewhere, e.g. replayed from a log.
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn observe(&self, iface: &InterfaceRuntime, obs: Observation) -> Result<(), Poisoned> {
        // The shadow learns from every observation the live policy learns from.
        if let Some(shadow) = &iface.arms.shadow {
            shadow.policy.observe(|| obs.clone());
        }
        let mut policy = self.policy_mut(iface)?;
        self.learn(iface, policy.as_mut(), obs);
        Ok(())
    }

    /// Feeds a quality score for `request_id` to the policy (and the shared journal).
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn record_quality(
        &self,
        iface: &InterfaceRuntime,
        request_id: &str,
        obs: &QualityObservation<'_>,
    ) -> Result<(), Poisoned> {
        let (live, ended) = super::arms::observe_quality(iface, request_id, obs, self.now().0);
        if let Some(end) = ended {
            self.journal_rollout_end(iface, end);
        }
        if !live {
            // The rollout's candidate routed it and learnt the score.
            self.journal(|| Event::RolloutLearn {
                iface: iface.name.clone(),
                obs: Observation::quality(obs),
            });
            return Ok(());
        }
        let mut policy = self.policy_mut(iface)?;
        policy.observe_quality(obs);
        self.journal(|| Event::Feedback {
            iface: iface.name.clone(),
            request_id: request_id.to_owned(),
            obs: Observation::quality(obs),
        });
        super::shifts::report(self, iface, policy.as_mut());
        Ok(())
    }

    /// Keeps an answered request's context until its quality score arrives (without
    /// allocating, once the store is warm, unless state is shared and journaled).
    pub fn remember(&self, request_id: &str, ctx: PendingContext<'_>) {
        self.journal(|| Event::Pending {
            request_id: request_id.to_owned(),
            ctx: ctx.to_feedback(),
        });
        if let Ok(mut pending) = self.pending.lock() {
            pending.remember(request_id, ctx);
        }
    }

    /// Opens a breaker until `until` because another instance opened its own (`pinned`: by
    /// a `Retry-After`).
    pub fn open_breaker(&self, iface: &str, candidate: usize, until: Timestamp, pinned: bool) {
        let Some(i) = self.interfaces.get(iface) else {
            return;
        };
        if let Ok(mut breakers) = i.breakers.lock() {
            if let Some(b) = breakers.get_mut(candidate) {
                if let Some(t) = b.open_until(until, pinned) {
                    self.metrics
                        .breaker(&i.candidates[candidate].id.0, transition_name(t));
                }
            }
        }
    }
}

impl From<Poisoned> for super::error::ApiError {
    fn from(_: Poisoned) -> Self {
        super::error::ApiError::internal()
    }
}

impl crate::shared::SyncTarget for AppState {
    fn shared(&self) -> Option<&crate::shared::SharedHandle> {
        self.shared.as_ref()
    }

    fn synced_interfaces(
        &self,
    ) -> Result<Vec<crate::shared::SyncedInterface>, crate::shared::SharedError> {
        // A side policy's copy, its deferred observations applied first.
        let side = |p: &super::arms::SidePolicy| {
            p.write()
                .map(|p| p.clone_box())
                .map_err(|_| crate::shared::SharedError::Redis("policy lock poisoned".into()))
        };
        self.interfaces
            .iter()
            .map(|(name, iface)| {
                let policy = iface.policy.read().map_err(|_| {
                    crate::shared::SharedError::Redis("policy lock poisoned".into())
                })?;
                Ok(crate::shared::SyncedInterface {
                    name: name.clone(),
                    providers: iface.candidates.iter().map(|c| c.id.0.clone()).collect(),
                    policy_name: iface.policy_name(),
                    feature_dim: iface.featurizer.dim(),
                    feature_max_words: iface.featurizer.max_words(),
                    policy: policy.clone_box(),
                    shadow: iface
                        .arms
                        .shadow
                        .as_ref()
                        .map(|s| side(&s.policy))
                        .transpose()?,
                    rollout: iface
                        .arms
                        .rollout
                        .as_ref()
                        .map(|r| side(&r.policy))
                        .transpose()?,
                })
            })
            .collect()
    }

    fn candidate_count(&self, iface: &str) -> usize {
        self.interfaces.get(iface).map_or(0, |i| i.candidates.len())
    }

    fn replace_live_policy(&self, iface: &str, rebuild: &mut dyn FnMut() -> Box<dyn Policy>) {
        let Some(iface) = self.interfaces.get(iface) else {
            return;
        };
        if let Ok(mut live) = self.policy_mut(iface) {
            *live = rebuild();
            super::shifts::discard(live.as_mut());
        }
    }

    fn replace_side_policy(
        &self,
        side: crate::shared::Side,
        iface: &str,
        rebuild: &mut dyn FnMut() -> Box<dyn Policy>,
    ) {
        let Some(arms) = self.interfaces.get(iface).map(|i| &i.arms) else {
            return;
        };
        let policy = match side {
            crate::shared::Side::Shadow => arms.shadow.as_ref().map(|s| &s.policy),
            crate::shared::Side::Rollout => arms.rollout.as_ref().map(|r| &r.policy),
        };
        if let Some(Ok(mut policy)) = policy.map(super::arms::SidePolicy::write) {
            *policy = rebuild();
        }
    }

    fn feedback_ttl(&self) -> Millis {
        self.feedback_ttl
    }

    fn pending_capacity(&self) -> usize {
        self.pending.lock().map_or(0, |p| p.capacity())
    }

    fn insert_pending(&self, request_id: &str, ctx: &PendingFeedback) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.insert(request_id, ctx);
        }
    }

    fn consume_pending(&self, request_id: &str) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.consume(request_id);
        }
    }

    fn open_breaker(&self, iface: &str, candidate: usize, until: Timestamp, pinned: bool) {
        AppState::open_breaker(self, iface, candidate, until, pinned);
    }

    fn end_rollout(&self, iface: &str, end: &crate::shared::RolloutEnd, own: bool) {
        if let Some(i) = self.interfaces.get(iface) {
            i.arms.apply_shared_end(iface, end, own);
        }
    }

    fn now(&self) -> Timestamp {
        AppState::now(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gateway of one simulated provider, seeded with `seed`.
    fn app_seeded(seed: u64) -> AppState {
        let text = "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 5, p95_ms = 9 } }\n";
        let cfg = crate::config::load(text, "t.toml", &|_| None).unwrap_or_else(|e| panic!("{e}"));
        AppState::new(&cfg, seed).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The ids of `n` requests on a fresh gateway seeded with `seed`, as numbers.
    fn ids(seed: u64, n: usize) -> Vec<u128> {
        let app = app_seeded(seed);
        (0..n)
            .map(|k| {
                let (number, id) = app.next_request();
                assert_eq!(number, k as u64, "numbers still count requests");
                let hex = id.strip_prefix("req-").unwrap_or_else(|| panic!("{id}"));
                assert_eq!(hex.len(), 32, "{id}");
                assert!(
                    hex.bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                    "{id}"
                );
                u128::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("{id}: {e}"))
            })
            .collect()
    }

    #[test]
    fn request_ids_are_128_random_bits_unrelated_to_the_seed_and_to_each_other() {
        let a = ids(7, 1000);
        // All distinct.
        let distinct: std::collections::HashSet<u128> = a.iter().copied().collect();
        assert_eq!(distinct.len(), 1000);
        // Not a function of the gateway's seed and the request number: another gateway with
        // the same seed issues other ids (the decisions' seeds stay reproducible).
        let b = ids(7, 1000);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        // No arithmetic relation between consecutive ids: neither their differences nor their
        // XORs repeat (a counter, an LCG or a multiplied counter repeats one or the other).
        let steps: std::collections::HashSet<u128> =
            a.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
        let flips: std::collections::HashSet<u128> = a.windows(2).map(|w| w[1] ^ w[0]).collect();
        assert_eq!((steps.len(), flips.len()), (999, 999));
        // Every one of the 128 bits is set in about half of the ids: 500 ± 100 is more than six
        // standard deviations (15.8) either side, so a fair generator fails one in ~10^8 runs;
        // 64-bit ids (the high half zero) or a stuck bit fail at once.
        for bit in 0..128 {
            let set = a.iter().filter(|id| (*id >> bit) & 1 == 1).count();
            assert!(
                (400..=600).contains(&set),
                "bit {bit} is set in {set} of 1000 ids"
            );
        }
        assert_eq!(
            app_seeded(7).seed_for(3),
            app_seeded(7).seed_for(3),
            "decisions stay seeded"
        );
    }

    #[test]
    fn an_attempt_that_finds_the_policy_locked_waits_in_the_queue_not_on_the_lock() {
        let text = "[interfaces.chat]\nkind = \"chat\"\nfeature_dim = 8\npolicy = { name = \"lqm-ts\" }\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 5, p95_ms = 9 } }\n[[interfaces.chat.providers]]\nid = \"b\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 5, p95_ms = 9 } }\n";
        let cfg = crate::config::load(text, "t.toml", &|_| None).unwrap_or_else(|e| panic!("{e}"));
        let app = AppState::new(&cfg, 1).unwrap_or_else(|e| panic!("{e}"));
        let iface = &app.interfaces["chat"];
        let features = iface.featurizer.featurize("a question");
        let export = || {
            let p = iface.policy.read().unwrap_or_else(|_| panic!("poisoned"));
            serde_json::to_string(&p.export_state()).unwrap_or_default()
        };
        let before = export();
        let failed = AttemptOutcome::with_status(
            900.0,
            equiroute_core::AttemptStatus::ProviderError(equiroute_core::ProviderFailure::Server),
        );
        {
            // A ranking holds the read side: the attempt must neither block nor be lost.
            let _rank = iface.policy.read().unwrap_or_else(|_| panic!("poisoned"));
            for _ in 0..3 {
                app.record_attempt(iface, 1, &features, SlicePath::root(), &failed, None)
                    .unwrap_or_else(|_| panic!("poisoned"));
            }
            assert_eq!(iface.deferred_len.load(Ordering::Acquire), 3);
        }
        assert_eq!(export(), before, "deferred, not yet applied");
        drop(app.policy_mut(iface).unwrap_or_else(|_| panic!("poisoned")));
        assert_eq!(iface.deferred_len.load(Ordering::Acquire), 0);
        let after = export();
        assert_ne!(
            after, before,
            "applied by the next holder of the write side"
        );
        // All three, each once: three attempts and three failures on candidate 1.
        let v: serde_json::Value = serde_json::from_str(&after).unwrap_or_default();
        assert_eq!(
            v["quality"]["heads"]["tries"],
            serde_json::json!([0, 3]),
            "{after}"
        );
        assert_eq!(v["risk"]["failures"][1]["count"], 3, "{after}");
    }
}
