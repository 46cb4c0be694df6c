//! The [`Syncer`], the background side of one instance: its confirmed copy of the policies, its
//! place in the shared log, and the sync (push, pull, rebuild, compact, announce) every interval.
//! What the syncer needs of a running gateway is the [`SyncTarget`] trait.

mod apply;
mod push;
mod seen;
mod snapshot;

use crate::config::RedisStateConfig;
use crate::pending::PendingFeedback;
use crate::shared::handle::SharedHandle;
use crate::shared::journal::RolloutEnd;
use crate::shared::namespace::{
    client, live_for, redis_err, timed, Keys, SharedError, StreamId, ACK_KEEP_S, EPOCH_SCRIPT,
    LIVE_SCRIPT, PULL_SCRIPT, PUSH_SCRIPT, RECOVER_SCRIPT, SNAPSHOT_SCRIPT,
};
use equiroute_core::policies::{Policy, PolicyState};
use equiroute_core::prelude::Featurizer;
use equiroute_core::{Millis, Timestamp};
use push::Batch;
use redis::aio::MultiplexedConnection;
use seen::SeenFeedback;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Stream entries read per request.
const READ_COUNT: usize = 500;

/// What one sync did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub pushed: usize,
    pub applied_entries: usize,
    pub applied_observations: usize,
    pub loaded_snapshot: bool,
    pub compacted: bool,
    /// Second scores for one request skipped (the first counts).
    pub duplicate_feedback: usize,
    /// Redis had lost the stream and this instance re-seeded it.
    pub reseeded: bool,
    /// Redis had lost the stream and this instance re-based on another's re-seed.
    pub rebased: bool,
}

/// The background side of one instance: its confirmed copy of the policies and its place
/// in the shared log.
pub struct Syncer {
    cfg: RedisStateConfig,
    keys: Keys,
    instance: String,
    client: redis::Client,
    conn: Option<MultiplexedConnection>,
    fingerprint: String,
    /// Empty policies, to load snapshots into.
    empty: BTreeMap<String, Box<dyn Policy>>,
    confirmed: BTreeMap<String, Box<dyn Policy>>,
    /// The shadows' empty policies and confirmed copies, by interface: every observation
    /// applied to an interface's confirmed policy is applied to its shadow's too.
    empty_shadows: BTreeMap<String, Box<dyn Policy>>,
    shadows: BTreeMap<String, Box<dyn Policy>>,
    /// The same for the rollouts' candidates, which learn from their own arm's observations.
    empty_rollouts: BTreeMap<String, Box<dyn Policy>>,
    rollouts: BTreeMap<String, Box<dyn Policy>>,
    /// Interfaces configured here with the policy a rollout promoted in this namespace, and
    /// no rollout: the promoted candidate's confirmed copy is kept for them as if they ran
    /// its rollout, so they follow the stream like the instances that did.
    adopted: BTreeSet<String>,
    /// The promotions among `ends` are to be written into the namespace's `promoted` hash
    /// at the next sync.
    promotions_unrecorded: bool,
    /// The first end of each interface's rollout in the stream's order (confirmed state).
    ends: BTreeMap<String, RolloutEnd>,
    /// Ends confirmed since the last sync, for the gateway to apply.
    announce: Vec<(String, RolloutEnd)>,
    cursor: StreamId,
    /// Highest own journal number the confirmed copy holds.
    own_confirmed: u64,
    /// Highest own journal number pushed or being pushed.
    pushed: u64,
    in_flight: Option<Batch>,
    /// The last acknowledged batch (kept to prove that sending it again appends nothing).
    last_acked: Option<Batch>,
    batches: u64,
    since_snapshot: u64,
    /// Bytes of the entries read since the last snapshot.
    since_snapshot_bytes: u64,
    /// Remote observations were applied: the live policies need a rebuild.
    stale_live: bool,
    /// The stream's epoch when this instance last synced (`None`: never synced).
    known_epoch: Option<String>,
    /// Request ids whose score the confirmed state holds, and how long they are kept.
    seen: SeenFeedback,
    seen_horizon: f64,
    seen_cap: usize,
    push_script: redis::Script,
    snapshot_script: redis::Script,
    epoch_script: redis::Script,
    recover_script: redis::Script,
    pull_script: redis::Script,
    live_script: redis::Script,
}

impl std::fmt::Debug for Syncer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Syncer")
            .field("namespace", &self.cfg.namespace)
            .field("instance", &self.instance)
            .field("cursor", &self.cursor)
            .finish_non_exhaustive()
    }
}

/// One interface as the syncer sees it: its name, what must match across instances, and a
/// copy of its (just built, empty) policy.
pub struct SyncedInterface {
    pub name: String,
    pub providers: Vec<String>,
    pub policy_name: &'static str,
    pub feature_dim: usize,
    pub feature_max_words: usize,
    pub policy: Box<dyn Policy>,
    /// A copy of its shadow policy (just built, empty), when it has one: the shadow learns
    /// from the same observations as the live policy, so from the same stream.
    pub shadow: Option<Box<dyn Policy>>,
    /// A copy of its rollout's candidate policy (just built, empty), when it has one.
    pub rollout: Option<Box<dyn Policy>>,
}

/// The side policies the stream teaches besides the live one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The shadow: the live policy's observations.
    Shadow,
    /// The rollout's candidate: the observations of the requests it routed.
    Rollout,
}

impl Side {
    /// The key of `iface`'s side state in a snapshot's map (`/` is never in an interface's
    /// name, so it cannot be another interface's key; instances that predate side policies
    /// in the stream ignore it).
    fn key(self, iface: &str) -> String {
        match self {
            Side::Shadow => format!("{iface}/shadow"),
            Side::Rollout => format!("{iface}/rollout"),
        }
    }
}

/// What the syncer needs of a running gateway. The server's state implements it, so this
/// module sits below the server and never names its types.
pub trait SyncTarget: Send + Sync {
    /// The journal, status and claims, when Redis is configured.
    fn shared(&self) -> Option<&SharedHandle>;
    /// Every interface, with a copy of its live policy.
    ///
    /// # Errors
    /// A poisoned policy lock.
    fn synced_interfaces(&self) -> Result<Vec<SyncedInterface>, SharedError>;
    /// The number of candidates of `iface` (0 for an unknown interface).
    fn candidate_count(&self, iface: &str) -> usize;
    /// Replaces the live policy of `iface` by what `rebuild` returns, under its write lock
    /// (so that no observation lands between the rebuild and the swap).
    fn replace_live_policy(&self, iface: &str, rebuild: &mut dyn FnMut() -> Box<dyn Policy>);
    /// Replaces the `side` policy of `iface`, if it has one, by what `rebuild` returns, under
    /// its write lock.
    fn replace_side_policy(
        &self,
        side: Side,
        iface: &str,
        rebuild: &mut dyn FnMut() -> Box<dyn Policy>,
    );
    /// How long an answered request waits for its feedback.
    fn feedback_ttl(&self) -> Millis;
    /// How many answered requests wait for feedback at most.
    fn pending_capacity(&self) -> usize;
    /// Another instance answered `request_id`: its feedback may arrive here.
    fn insert_pending(&self, request_id: &str, ctx: &PendingFeedback);
    /// Another instance took the feedback of `request_id`.
    fn consume_pending(&self, request_id: &str);
    /// Another instance opened a breaker (`pinned`: by a `Retry-After`).
    fn open_breaker(&self, iface: &str, candidate: usize, until: Timestamp, pinned: bool);
    /// The rollout of `iface` ended, first in the stream's order (`own`: this instance
    /// decided). A promotion's live policy arrives by [`SyncTarget::replace_live_policy`].
    fn end_rollout(&self, iface: &str, end: &RolloutEnd, own: bool);
    /// The gateway's clock.
    fn now(&self) -> Timestamp;
}

impl Syncer {
    /// The syncer of `state`, whose policies must still be empty (just built). Connects and
    /// checks that the namespace holds state of the same configuration (or of one whose
    /// promoted rollouts this configuration has made live, [`Self::follows_promotions`]); an
    /// unreachable Redis is not an error here (the instance starts on local state and syncs
    /// when it can).
    ///
    /// # Errors
    /// The URL is invalid, or the namespace belongs to another configuration.
    pub async fn start(
        cfg: &RedisStateConfig,
        state: &dyn SyncTarget,
    ) -> Result<Syncer, SharedError> {
        let client = client(cfg)?;
        let mut empty = BTreeMap::new();
        let mut confirmed = BTreeMap::new();
        let (mut empty_shadows, mut shadows) = (BTreeMap::new(), BTreeMap::new());
        let (mut empty_rollouts, mut rollouts) = (BTreeMap::new(), BTreeMap::new());
        let mut shape = Vec::new();
        for iface in state.synced_interfaces()? {
            empty.insert(iface.name.clone(), iface.policy.clone_box());
            // Not in the fingerprint: instances may run different shadows (or none).
            if let Some(shadow) = iface.shadow {
                empty_shadows.insert(iface.name.clone(), shadow.clone_box());
                shadows.insert(iface.name.clone(), shadow);
            }
            if let Some(rollout) = iface.rollout {
                empty_rollouts.insert(iface.name.clone(), rollout.clone_box());
                rollouts.insert(iface.name.clone(), rollout);
            }
            let mut entry = serde_json::json!({
                "interface": iface.name,
                "providers": iface.providers,
                "policy": iface.policy_name,
                "feature_dim": iface.feature_dim,
            });
            // Named only when changed, so that instances of earlier releases (which read the
            // whole text, the default's behaviour for every text under 128 words) still match.
            if iface.feature_max_words != Featurizer::DEFAULT_MAX_WORDS {
                entry["feature_max_words"] = iface.feature_max_words.into();
            }
            confirmed.insert(iface.name, iface.policy);
            shape.push(entry);
        }
        let instance = format!(
            "{:016x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
                ^ u64::from(std::process::id()).rotate_left(40)
        );
        let mut syncer = Syncer {
            keys: Keys::new(&cfg.namespace),
            cfg: cfg.clone(),
            instance,
            client,
            conn: None,
            fingerprint: serde_json::Value::Array(shape).to_string(),
            empty,
            confirmed,
            empty_shadows,
            shadows,
            empty_rollouts,
            rollouts,
            adopted: BTreeSet::new(),
            promotions_unrecorded: false,
            ends: BTreeMap::new(),
            announce: Vec::new(),
            cursor: StreamId::default(),
            own_confirmed: 0,
            pushed: 0,
            in_flight: None,
            last_acked: None,
            batches: 0,
            since_snapshot: 0,
            since_snapshot_bytes: 0,
            stale_live: false,
            known_epoch: None,
            seen: SeenFeedback::default(),
            seen_horizon: 2.0 * state.feedback_ttl().0,
            seen_cap: state.pending_capacity(),
            push_script: redis::Script::new(PUSH_SCRIPT),
            snapshot_script: redis::Script::new(SNAPSHOT_SCRIPT),
            epoch_script: redis::Script::new(EPOCH_SCRIPT),
            recover_script: redis::Script::new(RECOVER_SCRIPT),
            pull_script: redis::Script::new(PULL_SCRIPT),
            live_script: redis::Script::new(LIVE_SCRIPT),
        };
        match syncer.connection(state.shared()).await {
            Ok(_) | Err(SharedError::Redis(_)) => Ok(syncer),
            Err(e) => Err(e),
        }
    }

    /// This instance's id in the shared log.
    #[must_use]
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// Queues the last acknowledged batch to be sent again, as after an acknowledgement
    /// lost on the way back (for tests: the push script must not append it twice).
    #[doc(hidden)]
    pub fn resend_last_batch(&mut self) {
        if self.in_flight.is_none() {
            self.in_flight = self.last_acked.take();
        }
    }

    /// The confirmed learning state of every interface (what the shared log holds), of
    /// every shadow under `INTERFACE/shadow` and of every rollout's candidate under
    /// `INTERFACE/rollout`.
    #[must_use]
    pub fn confirmed_states(&self) -> BTreeMap<String, PolicyState> {
        self.confirmed
            .iter()
            .map(|(k, p)| (k.clone(), p.export_state()))
            .chain(
                self.sides()
                    .flat_map(|(side, map)| map.iter().map(move |(k, p)| (side.key(k), p)))
                    .map(|(k, p)| (k, p.export_state())),
            )
            .collect()
    }

    /// The side policies' confirmed copies.
    fn sides(&self) -> impl Iterator<Item = (Side, &BTreeMap<String, Box<dyn Policy>>)> {
        [
            (Side::Shadow, &self.shadows),
            (Side::Rollout, &self.rollouts),
        ]
        .into_iter()
    }

    /// The connection, opened (and the namespace checked) if needed; a second one is
    /// handed to the request path's feedback claims.
    async fn connection(
        &mut self,
        shared: Option<&SharedHandle>,
    ) -> Result<MultiplexedConnection, SharedError> {
        if let Some(c) = &self.conn {
            return Ok(c.clone());
        }
        let mut conn = timed(self.client.get_multiplexed_async_connection()).await?;
        let set: bool = timed(
            redis::cmd("SET")
                .arg(&self.keys.meta)
                .arg(&self.fingerprint)
                .arg("NX")
                .query_async::<Option<String>>(&mut conn),
        )
        .await?
        .is_some();
        if !set {
            let stored: Option<String> = timed(
                redis::cmd("GET")
                    .arg(&self.keys.meta)
                    .query_async(&mut conn),
            )
            .await?;
            if stored.as_deref() != Some(self.fingerprint.as_str()) {
                let promoted: BTreeMap<String, String> = timed(
                    redis::cmd("HGETALL")
                        .arg(&self.keys.promoted)
                        .query_async(&mut conn),
                )
                .await?;
                match stored {
                    Some(stored) if self.follows_promotions(&stored, &promoted) => {
                        // From now on this instance speaks for the namespace's configuration.
                        self.fingerprint = stored;
                    }
                    stored => {
                        return Err(SharedError::Mismatch {
                            namespace: self.cfg.namespace.clone(),
                            reason: format!(
                                "stored: {}; this configuration: {}",
                                stored.unwrap_or_default(),
                                self.fingerprint
                            ),
                        })
                    }
                }
            }
        }
        if let Some(shared) = shared {
            let claims = timed(self.client.get_multiplexed_async_connection()).await?;
            shared.claims.publish(Some(claims));
        }
        self.conn = Some(conn.clone());
        Ok(conn)
    }

    /// Whether this instance's configuration is the namespace's `stored` one with the live
    /// policy of some interfaces replaced by the policy a rollout promoted there
    /// (`promoted`, from the namespace's hash): the configuration an operator writes after
    /// a promotion, the promoted policy made the interface's own and the rollout removed.
    /// Such an interface is adopted: its candidate's confirmed copy is kept as if this
    /// instance ran the rollout (it must have none of its own).
    fn follows_promotions(&mut self, stored: &str, promoted: &BTreeMap<String, String>) -> bool {
        let Ok(serde_json::Value::Array(mut shape)) = serde_json::from_str(stored) else {
            return false;
        };
        let mut adopted = Vec::new();
        for entry in &mut shape {
            let Some(name) = entry["interface"].as_str().map(str::to_owned) else {
                return false;
            };
            let (Some(policy), Some(empty)) = (promoted.get(&name), self.empty.get(&name)) else {
                continue;
            };
            if entry["policy"] != policy.as_str()
                && empty.kind().as_str() == policy
                && !self.empty_rollouts.contains_key(&name)
            {
                entry["policy"] = policy.as_str().into();
                adopted.push(name);
            }
        }
        let here = serde_json::from_str::<serde_json::Value>(&self.fingerprint).ok();
        if adopted.is_empty() || here != Some(serde_json::Value::Array(shape)) {
            return false;
        }
        for name in adopted {
            if let Some(empty) = self.empty.get(&name).map(|p| p.clone_box()) {
                self.rollouts.insert(name.clone(), empty.clone_box());
                self.empty_rollouts.insert(name.clone(), empty);
            }
            tracing::info!(
                namespace = %self.cfg.namespace,
                interface = %name,
                "this instance runs the policy a rollout promoted in the shared namespace: it follows that promotion"
            );
            self.adopted.insert(name);
        }
        true
    }

    /// One push and pull. On a Redis error the connection is dropped (the next sync
    /// reconnects) and nothing is lost: unacknowledged batches are sent again, unread entries
    /// are read later.
    ///
    /// # Errors
    /// Redis is unreachable or answered with an error.
    pub async fn sync_once(&mut self, state: &dyn SyncTarget) -> Result<SyncReport, SharedError> {
        let result = self.sync_inner(state).await;
        if matches!(result, Err(SharedError::Redis(_) | SharedError::Auth(_))) {
            self.conn = None;
            if let Some(shared) = state.shared() {
                shared.claims.publish(None);
            }
        }
        result
    }

    async fn sync_inner(&mut self, state: &dyn SyncTarget) -> Result<SyncReport, SharedError> {
        let Some(shared) = state.shared() else {
            return Ok(SyncReport::default());
        };
        let mut conn = self.connection(Some(shared)).await?;
        let mut report = SyncReport {
            pushed: self.push(&mut conn, &shared.journal).await?,
            ..SyncReport::default()
        };
        // 2. Pull: from the snapshot if the entries after the cursor were trimmed, or if
        // Redis lost the stream this instance knew (then re-seeded from here or elsewhere).
        let ((snap_id, trimmed), epoch): ((Option<String>, Option<String>), Option<String>) =
            timed(
                redis::pipe()
                    .cmd("HMGET")
                    .arg(&self.keys.snapshot)
                    .arg("id")
                    .arg("trimmed")
                    .cmd("GET")
                    .arg(&self.keys.epoch)
                    .query_async(&mut conn),
            )
            .await?;
        let mut snap_id = snap_id.as_deref().and_then(StreamId::parse);
        if self
            .check_epoch(&mut conn, epoch, shared, &mut report)
            .await?
        {
            snap_id = None;
        }
        let trimmed = trimmed.as_deref().and_then(StreamId::parse);
        if !report.reseeded && !report.rebased && trimmed.is_some_and(|t| self.cursor < t) {
            self.load_snapshot(&mut conn).await?;
            report.loaded_snapshot = true;
        }
        loop {
            // Read only while the epoch is still the one checked above: entries of a stream
            // that replaced it meanwhile wait for the next sync's recovery.
            let entries: Option<Vec<(String, Vec<Vec<u8>>)>> = timed(
                self.pull_script
                    .key(&self.keys.log)
                    .key(&self.keys.epoch)
                    .arg(self.known_epoch.as_deref().unwrap_or_default())
                    .arg(format!("({}", self.cursor))
                    .arg(READ_COUNT)
                    .invoke_async(&mut conn),
            )
            .await?;
            let Some(entries) = entries else {
                break;
            };
            let n = entries.len();
            for (id, fields) in entries {
                let Some(id) = StreamId::parse(&id) else {
                    continue;
                };
                let applied = self.apply_entry(state, &fields, &mut report)?;
                report.applied_observations += applied;
                self.cursor = id;
                self.since_snapshot += 1;
                self.since_snapshot_bytes += fields.iter().map(|f| f.len() as u64).sum::<u64>();
                report.applied_entries += 1;
            }
            if n < READ_COUNT {
                break;
            }
        }
        // 3. Apply the rollouts' ends, and rebuild the live policies (a promotion swapped
        // the confirmed one).
        self.apply_ends(&mut conn, state).await?;
        if self.stale_live {
            self.rebuild_live(state);
            self.stale_live = false;
        }
        shared.journal.forget_through(self.own_confirmed);
        // 4. Compact now and then (another instance's newer snapshot counts too).
        if snap_id.is_some_and(|s| s > self.cursor) {
            self.snapshot_taken();
        }
        if self.since_snapshot >= self.cfg.compact_every
            || self.since_snapshot_bytes >= self.cfg.compact_bytes
        {
            let states = self.confirmed_states();
            let bytes = rmp_serde::to_vec_named(&states).map_err(|e| redis_err(&e))?;
            let seen = rmp_serde::to_vec_named(&self.seen).map_err(|e| redis_err(&e))?;
            let ends = rmp_serde::to_vec_named(&self.ends).map_err(|e| redis_err(&e))?;
            let _: i64 = timed(
                self.snapshot_script
                    .key(&self.keys.snapshot)
                    .key(&self.keys.log)
                    .key(&self.keys.acks)
                    .arg(self.cursor.to_string())
                    .arg(bytes)
                    .arg(seen)
                    .arg(ACK_KEEP_S)
                    .arg(ends)
                    .invoke_async(&mut conn),
            )
            .await?;
            self.snapshot_taken();
            report.compacted = true;
        }
        // 5. Say this instance is live (for `serve --reset-state` on another one).
        self.announce(&mut conn, live_for(self.cfg.sync_interval))
            .await?;
        Ok(report)
    }

    /// Announces this instance as live for `until` (zero: it leaves).
    async fn announce(
        &self,
        conn: &mut MultiplexedConnection,
        until: Duration,
    ) -> Result<(), SharedError> {
        let _: i64 = timed(
            self.live_script
                .key(&self.keys.live)
                .arg(&self.instance)
                .arg(until.as_millis() as u64)
                .invoke_async(conn),
        )
        .await?;
        Ok(())
    }

    /// Syncs every interval until `stop` resolves, then pushes once more.
    pub async fn run(
        mut self,
        state: std::sync::Arc<dyn SyncTarget>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut ticker = tokio::time::interval(self.cfg.sync_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.changed() => break,
            }
            self.tick(state.as_ref()).await;
        }
        self.tick(state.as_ref()).await;
        // Leaving: `--reset-state` on another instance need not wait for this one to expire.
        if let Ok(mut conn) = self.connection(state.shared()).await {
            let _ = self.announce(&mut conn, Duration::ZERO).await;
        }
    }

    /// One sync with its bookkeeping: status, metrics, one warning per outage.
    pub async fn tick(&mut self, state: &dyn SyncTarget) {
        let Some(shared) = state.shared() else {
            return;
        };
        let started = std::time::Instant::now();
        let result = tracing::Instrument::instrument(
            self.sync_once(state),
            tracing::debug_span!("redis_sync"),
        )
        .await;
        let status = &shared.status;
        status.syncs.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(report) => {
                status
                    .last_sync_us
                    .store(started.elapsed().as_micros() as u64, Ordering::Relaxed);
                status
                    .last_ok_unix_ms
                    .store(state.now().0 as u64, Ordering::Relaxed);
                status
                    .entries_applied
                    .fetch_add(report.applied_entries as u64, Ordering::Relaxed);
                status
                    .duplicates_skipped
                    .fetch_add(report.duplicate_feedback as u64, Ordering::Relaxed);
                if !status.connected.swap(true, Ordering::Relaxed)
                    && status.syncs.load(Ordering::Relaxed) > 1
                {
                    tracing::info!(
                        pushed = report.pushed,
                        "Redis state backend reachable again; pushed the observations learnt meanwhile"
                    );
                }
            }
            Err(e) => {
                status.errors.fetch_add(1, Ordering::Relaxed);
                if status.connected.swap(false, Ordering::Relaxed)
                    || status.syncs.load(Ordering::Relaxed) == 1
                {
                    tracing::warn!(
                        error = %e,
                        "Redis state sync failed; routing on local state, observations are kept and pushed when Redis returns"
                    );
                }
            }
        }
    }
}
