//! Learning state shared by several gateway instances through Redis (`[state] backend =
//! "redis"`).
//!
//! # How it works
//!
//! The request path never waits on Redis. Each instance applies its own observations to its
//! policies at once and also appends them to a local [`Journal`]. A background task, every
//! `sync_interval_ms`:
//!
//! 1. **pushes** the journal's new observations as one batch, appended to a Redis stream by a
//!    Lua script that also records the batch number per instance — so a batch whose
//!    acknowledgement was lost and is sent again is not appended twice;
//! 2. **pulls** every entry appended since its cursor (its own and the other instances'), and
//!    applies the observations, in the stream's order, to a *confirmed* copy of the policies;
//! 3. **rebuilds** the live policies as the confirmed copy plus the instance's own
//!    observations that are not yet in the stream.
//!
//! The stream gives one global order, so after a sync every instance holds exactly the
//! statistics of one instance that saw all the observations in that order — windows and
//! moving averages included, not just the sums. For the sums of sufficient statistics (the
//! quality heads' A and b, failure counts, log-latency moments) the order does not matter.
//!
//! Time: every observation carries the wall-clock time at which it was made, and decayed
//! sums weigh an observation by its own age (one that arrives late counts with the weight it
//! has decayed to), so decay is keyed by time, not by arrival. Sliding windows hold the last
//! `W` observations in the stream's order, the same on every instance.
//!
//! Shadows: an interface's shadow policy learns from every observation its live policy
//! learns from, so the syncer keeps a confirmed copy of it too, applies the same stream
//! entries to it and rebuilds it the same way; snapshots carry it under `INTERFACE/shadow`
//! (a snapshot without it, from an earlier release or an instance without a shadow, loads
//! with the shadow empty at it). A rollout's candidate learns from its own arm's
//! observations: they travel as [`Event::RolloutLearn`] in each entry's `r` field (which
//! earlier releases skip), are applied to a confirmed copy of the candidate, and snapshots
//! carry it under `INTERFACE/rollout`. The rollout's end is shared too: a rollback by an
//! instance's guard, an operator's abort or promotion travels as [`Event::RolloutEnd`] in
//! each entry's `e` field (which earlier releases skip); the first end of an interface's
//! rollout in the stream's order is the one every instance applies (a promotion swaps the
//! confirmed live policy for the confirmed candidate at that point of the stream), and
//! snapshots carry the ends (the hash's `rollouts` field), so an instance that joins later
//! starts with the rollout ended. Each instance's guard still counts the requests it routed.
//!
//! Breakers are per instance, but opening one (consecutive failures, a `Retry-After`) is
//! an event too: the others open theirs until the same time. The contexts of answered
//! requests travel the same way, so quality feedback can be posted to any instance.
//!
//! Compaction: every `compact_every` entries or `compact_bytes` bytes of entries (whichever
//! comes first) an instance writes a snapshot of the confirmed state with the stream id it
//! stands at, and the entries older than the *previous*
//! snapshot are trimmed. An instance whose cursor falls behind the trimmed part (a new
//! instance, a long partition) loads the snapshot instead of replaying.
//!
//! Redis down: the instance keeps routing on its live state, keeps its observations in the
//! journal (up to `max_unpushed`, oldest dropped and counted beyond that), logs one warning
//! per outage, shows it in `/metrics` and `/readyz`, and pushes the backlog when Redis
//! returns.
//!
//! Feedback exactly once: `POST /v1/feedback` on any instance first claims the request id
//! in Redis ([`Claims`]: `SET NX` with the feedback window as expiry, waiting at most
//! `claim_timeout_ms`); the instance that wins applies the score, any other answers
//! `duplicate`. When Redis does not answer in time the score is applied locally and
//! journaled, and the stream settles it: a feedback event carries its request id, and the
//! confirmed state skips a second score for an id it holds already (`SeenFeedback`, part
//! of the confirmed state and of snapshots), so every instance counts the first one in the
//! stream's order, once.
//!
//! Redis that lost the stream (restarted without persistence, flushed): an epoch key is
//! written with the stream. An instance that has synced before and finds the epoch missing
//! or changed knows the stream is gone; the first to notice claims the re-seed atomically
//! ([`RECOVER_SCRIPT`]) and stores its confirmed state as the snapshot the new stream starts
//! from (its backlog follows in the stream as usual); the others re-base on that snapshot
//! and push their own backlogs. A new instance then starts from everything.
//!
//! That is also why [`reset`] (`serve --reset-state`) is refused while an instance runs: it
//! would re-seed the deleted state within a sync. Each instance announces itself at every
//! sync in the namespace's live set (`LIVE_SCRIPT`) and leaves it when it stops cleanly.

use crate::config::RedisStateConfig;
use crate::pending::PendingFeedback;
use equiroute_core::policies::{Observation, Policy, PolicyState};
use equiroute_core::prelude::Featurizer;
use equiroute_core::{Millis, Timestamp};
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Longest wait for one Redis command before the sync counts Redis as unreachable.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
/// Most observations in one pushed batch.
const BATCH_MAX: usize = 5_000;
/// Stream entries read per request.
const READ_COUNT: usize = 500;

/// Appends one batch, unless this instance's batch number was appended already. The acks
/// hash holds, per instance, its last appended batch number and when (Redis's clock, in
/// seconds): `number:seconds` (a bare `number` was written before the time was kept).
const PUSH_SCRIPT: &str = r"
local v = redis.call('HGET', KEYS[2], ARGV[1])
local done = v and tonumber(string.match(v, '^%d+')) or 0
if tonumber(ARGV[2]) <= done then return 0 end
local fields = {'i', ARGV[1], 's', ARGV[3], 'b', ARGV[4]}
if #ARGV[5] > 0 then
  table.insert(fields, 'r')
  table.insert(fields, ARGV[5])
end
if #ARGV[6] > 0 then
  table.insert(fields, 'e')
  table.insert(fields, ARGV[6])
end
redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ':' .. redis.call('TIME')[1])
return 1
";

/// How long an instance's acknowledgement is kept after its last append. Every start is a
/// new instance id, so without an end the acks hash would keep one field per start for
/// ever; the acknowledgement only guards a batch resent after its answer was lost, which
/// a live instance does within seconds.
const ACK_KEEP_S: u64 = 7 * 24 * 3600;

/// Stores a snapshot if it is newer than the stored one, and trims the stream up to the
/// previous snapshot. Every compaction also drops the acknowledgements of instances that
/// appended nothing for `ARGV[4]` seconds (and those written without a time).
const SNAPSHOT_SCRIPT: &str = r"
local now = tonumber(redis.call('TIME')[1])
local acks = redis.call('HGETALL', KEYS[3])
for i = 1, #acks, 2 do
  local t = tonumber(string.match(acks[i + 1], ':(%d+)$') or '0')
  if now - t > tonumber(ARGV[4]) then redis.call('HDEL', KEYS[3], acks[i]) end
end
local function parts(id)
  local ms, seq = string.match(id, '(%d+)-(%d+)')
  return tonumber(ms), tonumber(seq)
end
local cur = redis.call('HGET', KEYS[1], 'id')
if cur then
  local am, as = parts(ARGV[1])
  local bm, bs = parts(cur)
  if am < bm or (am == bm and as <= bs) then return 0 end
end
local trimmed = cur or '0-0'
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'data', ARGV[2], 'seen', ARGV[3], 'trimmed', trimmed, 'rollouts', ARGV[5])
redis.call('XTRIM', KEYS[2], 'MINID', trimmed)
return 1
";

/// Announces instance `ARGV[1]` as live for `ARGV[2]` more milliseconds of Redis's clock
/// (`0`: it leaves), and forgets the instances whose announcement ran out. The live set is
/// what `serve --reset-state` checks: a live instance would write its learning back.
const LIVE_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if tonumber(ARGV[2]) > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
";

/// Deletes every key of the namespace (`KEYS[1]` is the live set), unless an instance is
/// live: then returns the live instances and deletes nothing.
const RESET_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local live = redis.call('ZRANGE', KEYS[1], 0, -1)
if #live > 0 then return live end
redis.call('DEL', unpack(KEYS))
return {}
";

/// How long an instance counts as live after its last sync: three sync intervals, at least
/// two seconds (an instance killed without leaving is forgotten after that).
fn live_for(sync_interval: Duration) -> Duration {
    (sync_interval * 3).max(Duration::from_secs(2))
}

/// The epoch of the stream, read or created (`fresh:…`) by an instance's first sync.
const EPOCH_SCRIPT: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur then return cur end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
";

/// Called by an instance that finds the epoch it knew missing or changed (Redis lost the
/// stream). Unchanged after all: `{0}`. Re-seeded by another instance (`reseed:…`): `{1}`,
/// re-base on its snapshot. Missing, or `fresh:…` (made by an instance that never saw the
/// old stream): this instance claims the re-seed, `{2}`, and its confirmed state becomes
/// the snapshot the new stream starts from (at [`RESEED_ID`], before any entry). Another
/// configuration took the namespace meanwhile: `{3}`.
pub const RECOVER_SCRIPT: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return {0, cur} end
if cur and string.sub(cur, 1, 7) == 'reseed:' then return {1, cur} end
local meta = redis.call('GET', KEYS[3])
if meta and meta ~= ARGV[5] then return {3, meta} end
redis.call('SET', KEYS[3], ARGV[5])
redis.call('SET', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'id', '0-1', 'trimmed', '0-1', 'data', ARGV[3], 'seen', ARGV[4], 'rollouts', ARGV[6])
return {2, ARGV[2]}
";

/// Where a re-seeded stream's snapshot stands: before every entry (`XADD *` ids are
/// milliseconds), after a new instance's cursor (`0-0`), so that one loads it.
const RESEED_ID: StreamId = StreamId(0, 1);

/// Reads up to `ARGV[3]` entries after `ARGV[2]`, unless the epoch is no longer `ARGV[1]`
/// (then nil): an instance never reads the entries of a stream that replaced the one it knew
/// before it has recovered.
const PULL_SCRIPT: &str = r"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return false end
return redis.call('XRANGE', KEYS[1], ARGV[2], '+', 'COUNT', ARGV[3])
";

/// One learning event of an instance, as it travels through Redis.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// An observation for interface `iface`'s policy.
    Learn { iface: String, obs: Observation },
    /// A quality score for request `request_id` (its context is consumed everywhere).
    Feedback {
        iface: String,
        request_id: String,
        obs: Observation,
    },
    /// An observation for interface `iface`'s rollout candidate (a request it routed, or the
    /// quality score of one). Pushed in the entry's `r` field, apart from the others, so that
    /// instances of earlier releases (which read only `b`) skip it rather than the batch.
    RolloutLearn { iface: String, obs: Observation },
    /// Interface `iface`'s rollout ended (rolled back, aborted or promoted). Pushed in the
    /// entry's `e` field, which earlier releases skip.
    RolloutEnd { iface: String, end: RolloutEnd },
    /// The context of an answered request, so that its feedback can reach any instance.
    Pending {
        request_id: String,
        ctx: PendingFeedback,
    },
    /// A breaker opened until `until` (failures, or a provider's `Retry-After`).
    BreakerOpen {
        iface: String,
        candidate: usize,
        until: Timestamp,
        /// Set by the provider (`Retry-After`), not by failures; events of earlier
        /// releases, which did not say, count as pinned (never ended early).
        #[serde(default = "pinned_by_default")]
        pinned: bool,
    },
}

fn pinned_by_default() -> bool {
    true
}

/// How a rollout ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutOutcome {
    RolledBack,
    Aborted,
    Promoted,
}

/// The end of an interface's rollout, as it travels between instances.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RolloutEnd {
    /// The candidate's policy: applied only to a rollout of the same policy.
    pub policy: String,
    pub outcome: RolloutOutcome,
    /// A rollback's guard metric (`bad_rate` or `quality`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<String>,
    pub at_unix_ms: f64,
    /// A rollback's evidence, as the deciding instance's guard measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<equiroute_core::sequential::Comparison>,
    /// The instance that decided (set from the stream entry it arrived in).
    #[serde(default)]
    pub instance: String,
}

/// This instance's events that the shared log does not hold yet, numbered from 1.
#[derive(Debug)]
pub struct Journal {
    inner: Mutex<JournalInner>,
    max: usize,
}

#[derive(Debug, Default)]
struct JournalInner {
    next: u64,
    events: VecDeque<(u64, Event)>,
    dropped: u64,
}

impl Journal {
    /// A journal keeping at most `max` events.
    #[must_use]
    pub fn new(max: usize) -> Journal {
        Journal {
            inner: Mutex::new(JournalInner::default()),
            max: max.max(1),
        }
    }

    /// Appends an event.
    pub fn record(&self, event: Event) {
        if let Ok(mut j) = self.inner.lock() {
            j.next += 1;
            let seq = j.next;
            j.events.push_back((seq, event));
            if j.events.len() > self.max {
                j.events.pop_front();
                j.dropped += 1;
            }
        }
    }

    /// Up to `limit` events numbered after `seq`, in order.
    fn after(&self, seq: u64, limit: usize) -> Vec<(u64, Event)> {
        self.inner.lock().map_or_else(
            |_| Vec::new(),
            |j| {
                j.events
                    .iter()
                    .filter(|(s, _)| *s > seq)
                    .take(limit)
                    .cloned()
                    .collect()
            },
        )
    }

    /// Applies to `policy`, in order and without copying them, the observations of interface
    /// `iface` numbered after `seq` (its rollout candidate's when `rollout`, else the live
    /// policy's), but not the scores of requests `scored` says the confirmed state holds
    /// already. Callers hold that interface's policy lock first (the order the request path
    /// takes them in).
    fn replay_after(
        &self,
        seq: u64,
        (iface, rollout): (&str, bool),
        policy: &mut dyn Policy,
        scored: &dyn Fn(&str) -> bool,
    ) {
        if let Ok(j) = self.inner.lock() {
            for (_, event) in j.events.iter().filter(|(s, _)| *s > seq) {
                let obs = match event {
                    Event::Learn { iface: i, obs } if !rollout && i == iface => obs,
                    Event::Feedback {
                        iface: i,
                        request_id,
                        obs,
                    } if !rollout && i == iface && !scored(request_id) => obs,
                    Event::RolloutLearn { iface: i, obs } if rollout && i == iface => obs,
                    _ => continue,
                };
                obs.apply(policy);
            }
        }
    }

    /// Forgets the events numbered up to `seq` (the log holds them now).
    fn forget_through(&self, seq: u64) {
        if let Ok(mut j) = self.inner.lock() {
            while j.events.front().is_some_and(|(s, _)| *s <= seq) {
                j.events.pop_front();
            }
        }
    }

    /// Events kept, and events dropped because the journal was full.
    #[must_use]
    pub fn counts(&self) -> (usize, u64) {
        self.inner
            .lock()
            .map_or((0, 0), |j| (j.events.len(), j.dropped))
    }
}

/// What the sync task tells the rest of the gateway.
#[derive(Debug, Default)]
pub struct SyncStatus {
    pub connected: AtomicBool,
    /// Wall-clock ms of the last successful sync (0: none yet).
    pub last_ok_unix_ms: AtomicU64,
    pub syncs: AtomicU64,
    pub errors: AtomicU64,
    /// Entries read from the shared log.
    pub entries_applied: AtomicU64,
    /// Duration of the last successful sync, µs.
    pub last_sync_us: AtomicU64,
    /// Second scores for one request (accepted by two instances without Redis) that the
    /// stream settled by counting the first.
    pub duplicates_skipped: AtomicU64,
    /// Times Redis was found to have lost the stream (re-seeded by this instance or
    /// re-based on another's).
    pub recoveries: AtomicU64,
}

/// The shared-state hooks of a gateway instance: its journal, the sync status and the
/// feedback claims.
#[derive(Debug)]
pub struct SharedHandle {
    pub journal: Journal,
    pub status: SyncStatus,
    pub claims: Claims,
}

/// What became of a claim of a request's feedback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This instance holds the claim: it applies the score.
    Won,
    /// Another instance claimed it first: a duplicate.
    Lost,
    /// Redis did not answer within `claim_timeout_ms` (or is unreachable): the score is
    /// applied locally, and counted once when the instances sync.
    Unavailable,
}

/// The request path's claims of feedback in Redis: `{namespace}:fb:{request_id}`, set if
/// absent and expiring with the feedback window. The connection is opened by the sync task
/// (a second one, so that a large pull or snapshot never delays a claim): the request path
/// never connects, and waits at most `claim_timeout`.
pub struct Claims {
    conn: Mutex<Option<MultiplexedConnection>>,
    prefix: String,
    timeout: Duration,
    /// Claims won, lost, and unavailable (applied locally).
    outcomes: [AtomicU64; 3],
}

impl std::fmt::Debug for Claims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claims")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Claims {
    fn new(prefix: String, timeout: Duration) -> Claims {
        Claims {
            conn: Mutex::new(None),
            prefix,
            timeout,
            outcomes: Default::default(),
        }
    }

    fn publish(&self, conn: Option<MultiplexedConnection>) {
        if let Ok(mut c) = self.conn.lock() {
            *c = conn;
        }
    }

    /// Claims the feedback of `request_id` for `window` (the feedback TTL).
    pub async fn claim(&self, request_id: &str, window: Millis) -> Claim {
        let conn = self.conn.lock().ok().and_then(|c| c.clone());
        let outcome = match conn {
            None => Claim::Unavailable,
            Some(mut conn) => {
                let mut set = redis::cmd("SET");
                set.arg(format!("{}{request_id}", self.prefix))
                    .arg(1)
                    .arg("NX")
                    .arg("PX")
                    .arg(window.0.ceil().max(1.0) as u64);
                match tokio::time::timeout(
                    self.timeout,
                    set.query_async::<Option<String>>(&mut conn),
                )
                .await
                {
                    Ok(Ok(Some(_))) => Claim::Won,
                    Ok(Ok(None)) => Claim::Lost,
                    Ok(Err(_)) | Err(_) => Claim::Unavailable,
                }
            }
        };
        let slot = match outcome {
            Claim::Won => 0,
            Claim::Lost => 1,
            Claim::Unavailable => 2,
        };
        self.outcomes[slot].fetch_add(1, Ordering::Relaxed);
        outcome
    }
}

impl SharedHandle {
    /// The hooks of an instance configured by `cfg`.
    #[must_use]
    pub fn new(cfg: &RedisStateConfig) -> SharedHandle {
        SharedHandle {
            journal: Journal::new(cfg.max_unpushed),
            status: SyncStatus::default(),
            claims: Claims::new(Keys::new(&cfg.namespace).claims, cfg.claim_timeout),
        }
    }

    /// Appends the sync metrics to a Prometheus exposition.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        let s = &self.status;
        let (unpushed, dropped) = self.journal.counts();
        let rows = [
            (
                "equiroute_state_redis_up",
                u64::from(s.connected.load(Ordering::Relaxed)),
            ),
            (
                "equiroute_state_syncs_total",
                s.syncs.load(Ordering::Relaxed),
            ),
            (
                "equiroute_state_sync_errors_total",
                s.errors.load(Ordering::Relaxed),
            ),
            (
                "equiroute_state_entries_applied_total",
                s.entries_applied.load(Ordering::Relaxed),
            ),
            (
                "equiroute_state_last_sync_microseconds",
                s.last_sync_us.load(Ordering::Relaxed),
            ),
            ("equiroute_state_unpushed_events", unpushed as u64),
        ];
        for (name, value) in rows {
            let _ = writeln!(out, "{name} {value}");
        }
        let _ = writeln!(out, "equiroute_state_dropped_events_total {dropped}");
        for (label, n) in ["won", "lost", "unavailable"]
            .iter()
            .zip(&self.claims.outcomes)
        {
            let _ = writeln!(
                out,
                "equiroute_state_feedback_claims_total{{outcome=\"{label}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "equiroute_state_duplicate_feedback_skipped_total {}",
            s.duplicates_skipped.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "equiroute_state_recoveries_total {}",
            s.recoveries.load(Ordering::Relaxed)
        );
    }

    /// The `/readyz` detail.
    #[must_use]
    pub fn readiness(&self, now: Timestamp) -> serde_json::Value {
        let s = &self.status;
        let last = s.last_ok_unix_ms.load(Ordering::Relaxed);
        let (unpushed, dropped) = self.journal.counts();
        serde_json::json!({
            "backend": "redis",
            "redis_reachable": s.connected.load(Ordering::Relaxed),
            "last_sync_age_ms": (last > 0).then(|| (now.0 - last as f64).max(0.0).round()),
            "unpushed_events": unpushed,
            "dropped_events": dropped,
        })
    }
}

/// A shared state that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error("state.namespace `{namespace}`: Redis holds the state of another configuration ({reason}). Fix: use another state.namespace, or start one instance with `equiroute serve --reset-state` to delete the shared state")]
    Mismatch { namespace: String, reason: String },
    #[error("Redis state backend: {0}")]
    Redis(String),
    /// `--reset-state` while instances of the namespace run: they would write their
    /// learning back within a sync.
    #[error("state.namespace `{namespace}`: {count} instance(s) of this namespace are running and would write their learning back into Redis at their next sync, so nothing was deleted. Fix: stop every instance of the namespace, then start one with `--reset-state`; an instance stopped without a clean exit counts as running for {forgotten_s} s after its last sync")]
    Live {
        namespace: String,
        count: usize,
        forgotten_s: u64,
    },
}

/// A stream entry id, `ms-seq`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct StreamId(pub u64, pub u64);

impl StreamId {
    fn parse(s: &str) -> Option<StreamId> {
        let (ms, seq) = s.split_once('-')?;
        Some(StreamId(ms.parse().ok()?, seq.parse().ok()?))
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// A batch being pushed; sent again as it is until Redis acknowledges it.
#[derive(Debug)]
struct Batch {
    number: u64,
    last_seq: u64,
    bytes: Vec<u8>,
    /// The rollout candidates' observations (the `r` field; empty: none).
    rollout: Vec<u8>,
    /// The rollouts' ends (the `e` field; empty: none).
    ends: Vec<u8>,
}

/// Key names, all with one hash tag so that a Redis Cluster keeps them on one node.
#[derive(Debug)]
struct Keys {
    log: String,
    acks: String,
    snapshot: String,
    meta: String,
    epoch: String,
    /// The promoted rollouts' policies by interface (a hash), so that instances configured
    /// with a promoted policy recognise the namespace ([`Syncer::follows_promotions`]).
    promoted: String,
    /// Prefix of the feedback claims (`{ns}:fb:` and the request id).
    claims: String,
    /// The live instances (a sorted set: instance id, until when in Redis's milliseconds).
    live: String,
}

impl Keys {
    fn new(ns: &str) -> Keys {
        Keys {
            log: format!("{{{ns}}}:log"),
            acks: format!("{{{ns}}}:acks"),
            snapshot: format!("{{{ns}}}:snapshot"),
            meta: format!("{{{ns}}}:meta"),
            epoch: format!("{{{ns}}}:epoch"),
            promoted: format!("{{{ns}}}:promoted"),
            claims: format!("{{{ns}}}:fb:"),
            live: format!("{{{ns}}}:live"),
        }
    }
}

/// Request ids whose score the confirmed state holds, oldest first. A second score for one
/// (two instances that each accepted it while Redis was unreachable) is skipped in the
/// stream's order, so every instance counts the first one only; snapshots carry the set,
/// since it is part of the confirmed state. Bounded the same way on every instance: ids are
/// kept while scored within `horizon` (twice the feedback window) of the newest score — a
/// request's scores all arrive within one window of its answer — and at most `cap` of them
/// (the pending store's size: no instance holds more contexts that could still be scored).
#[derive(Debug, Default, Serialize, Deserialize)]
struct SeenFeedback {
    order: VecDeque<(String, f64)>,
    newest: f64,
    #[serde(skip)]
    ids: HashSet<String>,
}

impl SeenFeedback {
    /// Records `id`, scored at `at` (ms); false when it is recorded already.
    fn insert(&mut self, id: &str, at: f64, horizon: f64, cap: usize) -> bool {
        if self.ids.contains(id) {
            return false;
        }
        self.ids.insert(id.to_owned());
        self.order.push_back((id.to_owned(), at));
        self.newest = self.newest.max(at);
        while self.order.len() > cap.max(1)
            || self
                .order
                .front()
                .is_some_and(|(_, t)| *t < self.newest - horizon)
        {
            if let Some((old, _)) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        true
    }

    fn contains(&self, id: &str) -> bool {
        self.ids.contains(id)
    }

    /// The set stored with a snapshot (empty when the snapshot has none: older releases).
    fn from_bytes(bytes: Option<&[u8]>) -> Result<SeenFeedback, SharedError> {
        let Some(bytes) = bytes else {
            return Ok(SeenFeedback::default());
        };
        let mut seen: SeenFeedback = rmp_serde::from_slice(bytes).map_err(|e| {
            SharedError::Redis(format!(
                "the shared snapshot's feedback ids cannot be read ({e})"
            ))
        })?;
        seen.ids = seen.order.iter().map(|(id, _)| id.clone()).collect();
        Ok(seen)
    }
}

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

fn redis_err(e: &dyn std::fmt::Display) -> SharedError {
    SharedError::Redis(e.to_string())
}

async fn timed<T>(
    f: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> Result<T, SharedError> {
    match tokio::time::timeout(COMMAND_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(redis_err(&e)),
        Err(_) => Err(SharedError::Redis(format!(
            "no answer within {} s",
            COMMAND_TIMEOUT.as_secs()
        ))),
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

    /// A new epoch value of `kind` (`fresh` or `reseed`), unique to this instance and time.
    fn new_epoch(&self, kind: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{kind}:{}:{nanos}", self.instance)
    }

    /// Redis lost the stream this instance knew (epoch `known`): re-seed it from the
    /// confirmed state, or re-base on another instance's re-seed.
    async fn recover(
        &mut self,
        conn: &mut MultiplexedConnection,
        known: &str,
        report: &mut SyncReport,
    ) -> Result<(), SharedError> {
        let data = rmp_serde::to_vec_named(&self.confirmed_states()).map_err(|e| redis_err(&e))?;
        let seen = rmp_serde::to_vec_named(&self.seen).map_err(|e| redis_err(&e))?;
        let ends = rmp_serde::to_vec_named(&self.ends).map_err(|e| redis_err(&e))?;
        let (code, epoch): (i64, String) = timed(
            self.recover_script
                .key(&self.keys.epoch)
                .key(&self.keys.snapshot)
                .key(&self.keys.meta)
                .arg(known)
                .arg(self.new_epoch("reseed"))
                .arg(data)
                .arg(seen)
                .arg(&self.fingerprint)
                .arg(ends)
                .invoke_async(conn),
        )
        .await?;
        match code {
            0 => {}
            1 => {
                self.load_snapshot(conn).await?;
                tracing::warn!(
                    namespace = %self.cfg.namespace,
                    "Redis lost the shared state; re-based on the state another instance re-seeded"
                );
                report.loaded_snapshot = true;
                report.rebased = true;
            }
            2 => {
                // The confirmed state is the snapshot now; the new stream's entries follow.
                self.promotions_unrecorded = true;
                self.cursor = RESEED_ID;
                self.snapshot_taken();
                self.stale_live = true;
                tracing::warn!(
                    namespace = %self.cfg.namespace,
                    "Redis lost the shared state; re-seeded it from this instance's state"
                );
                report.reseeded = true;
            }
            _ => {
                return Err(SharedError::Mismatch {
                    namespace: self.cfg.namespace.clone(),
                    reason: format!("stored: {epoch}; this configuration: {}", self.fingerprint),
                })
            }
        }
        if code != 3 {
            self.known_epoch = Some(epoch);
        }
        Ok(())
    }

    /// One push and pull. On a Redis error the connection is dropped (the next sync
    /// reconnects) and nothing is lost: unacknowledged batches are sent again, unread entries
    /// are read later.
    ///
    /// # Errors
    /// Redis is unreachable or answered with an error.
    pub async fn sync_once(&mut self, state: &dyn SyncTarget) -> Result<SyncReport, SharedError> {
        let result = self.sync_inner(state).await;
        if matches!(result, Err(SharedError::Redis(_))) {
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

    /// Hands the rollouts' ends confirmed since the last sync to the gateway, after writing
    /// the promotions among the ends into the namespace's hash (the same values from every
    /// instance: the first end in the stream holds).
    async fn apply_ends(
        &mut self,
        conn: &mut MultiplexedConnection,
        state: &dyn SyncTarget,
    ) -> Result<(), SharedError> {
        if self.promotions_unrecorded {
            let mut cmd = redis::cmd("HSET");
            cmd.arg(&self.keys.promoted);
            let mut any = false;
            for (iface, end) in &self.ends {
                if end.outcome == RolloutOutcome::Promoted {
                    cmd.arg(iface).arg(&end.policy);
                    any = true;
                }
            }
            if any {
                let _: i64 = timed(cmd.query_async(conn)).await?;
            }
            self.promotions_unrecorded = false;
        }
        for (iface, end) in std::mem::take(&mut self.announce) {
            let own = end.instance == self.instance;
            state.end_rollout(&iface, &end, own);
        }
        Ok(())
    }

    /// A snapshot stands at (or past) the cursor: the count towards the next compaction
    /// starts again.
    fn snapshot_taken(&mut self) {
        self.since_snapshot = 0;
        self.since_snapshot_bytes = 0;
    }

    /// Compares the stream's `epoch` with the one this instance knew, and recovers when
    /// Redis lost the stream; true when it did (the snapshot read before is stale then).
    async fn check_epoch(
        &mut self,
        conn: &mut MultiplexedConnection,
        epoch: Option<String>,
        shared: &SharedHandle,
        report: &mut SyncReport,
    ) -> Result<bool, SharedError> {
        match (self.known_epoch.clone(), epoch) {
            (Some(known), current) if current.as_ref() != Some(&known) => {
                shared.status.recoveries.fetch_add(1, Ordering::Relaxed);
                self.recover(conn, &known, report).await?;
                return Ok(true);
            }
            (None, Some(current)) => self.known_epoch = Some(current),
            (None, None) => {
                let epoch: String = timed(
                    self.epoch_script
                        .key(&self.keys.epoch)
                        .arg(self.new_epoch("fresh"))
                        .invoke_async(conn),
                )
                .await?;
                self.known_epoch = Some(epoch);
            }
            (Some(_), _) => {}
        }
        Ok(false)
    }

    /// Pushes the journal's new events, one batch at a time; returns how many.
    async fn push(
        &mut self,
        conn: &mut MultiplexedConnection,
        journal: &Journal,
    ) -> Result<usize, SharedError> {
        let mut pushed = 0;
        loop {
            if self.in_flight.is_none() {
                let events = journal.after(self.pushed, BATCH_MAX);
                let Some(&(last_seq, _)) = events.last() else {
                    break;
                };
                let (mut list, mut rollout, mut ends) = (Vec::new(), Vec::new(), Vec::new());
                for (_, e) in &events {
                    match e {
                        Event::RolloutLearn { .. } => rollout.push(e),
                        Event::RolloutEnd { .. } => ends.push(e),
                        _ => list.push(e),
                    }
                }
                let bytes = rmp_serde::to_vec_named(&list).map_err(|e| redis_err(&e))?;
                let field = |events: &[&Event]| {
                    if events.is_empty() {
                        Ok(Vec::new())
                    } else {
                        rmp_serde::to_vec_named(events).map_err(|e| redis_err(&e))
                    }
                };
                let (rollout, ends) = (field(&rollout)?, field(&ends)?);
                self.batches += 1;
                self.pushed = last_seq;
                pushed += events.len();
                self.in_flight = Some(Batch {
                    number: self.batches,
                    last_seq,
                    bytes,
                    rollout,
                    ends,
                });
            }
            if let Some(batch) = &self.in_flight {
                let _: i64 = timed(
                    self.push_script
                        .key(&self.keys.log)
                        .key(&self.keys.acks)
                        .arg(&self.instance)
                        .arg(batch.number)
                        .arg(batch.last_seq)
                        .arg(batch.bytes.as_slice())
                        .arg(batch.rollout.as_slice())
                        .arg(batch.ends.as_slice())
                        .invoke_async(conn),
                )
                .await?;
            }
            self.last_acked = self.in_flight.take();
        }
        Ok(pushed)
    }

    /// Replaces the confirmed policies with the stored snapshot.
    async fn load_snapshot(&mut self, conn: &mut MultiplexedConnection) -> Result<(), SharedError> {
        type Fields = (
            Option<String>,
            Option<Vec<u8>>,
            Option<Vec<u8>>,
            Option<Vec<u8>>,
        );
        let (id, data, seen, ends): Fields = timed(
            redis::cmd("HMGET")
                .arg(&self.keys.snapshot)
                .arg("id")
                .arg("data")
                .arg("seen")
                .arg("rollouts")
                .query_async(conn),
        )
        .await?;
        let (Some(id), Some(data)) = (id.as_deref().and_then(StreamId::parse), data) else {
            return Err(SharedError::Redis(
                "the shared snapshot is incomplete".into(),
            ));
        };
        let states: BTreeMap<String, PolicyState> = rmp_serde::from_slice(&data)
            .map_err(|e| SharedError::Redis(format!("the shared snapshot cannot be read ({e})")))?;
        self.seen = SeenFeedback::from_bytes(seen.as_deref())?;
        // Written before rollouts' ends were shared (or empty): none ended.
        let ends: BTreeMap<String, RolloutEnd> = match ends.as_deref() {
            None | Some([]) => BTreeMap::new(),
            Some(bytes) => rmp_serde::from_slice(bytes).map_err(|e| {
                SharedError::Redis(format!(
                    "the shared snapshot's rollout ends cannot be read ({e})"
                ))
            })?,
        };
        for (name, end) in &ends {
            self.check_end(name, end)?;
        }
        for (name, empty) in &self.empty {
            // A promoted rollout's candidate is the live policy from its promotion on.
            let promoted = ends
                .get(name)
                .filter(|e| e.outcome == RolloutOutcome::Promoted)
                .and_then(|_| self.empty_rollouts.get(name));
            let mut fresh = promoted.unwrap_or(empty).clone_box();
            // Adopted and not yet promoted in this snapshot: its live state is the old policy's,
            // which the promotion further on in the stream replaces.
            let old_live = self.adopted.contains(name) && promoted.is_none();
            if let Some(s) = states.get(name).filter(|_| !old_live) {
                fresh.merge_state(s).map_err(|e| SharedError::Mismatch {
                    namespace: self.cfg.namespace.clone(),
                    reason: format!("interface `{name}`: {e}"),
                })?;
            }
            self.confirmed.insert(name.clone(), fresh);
        }
        self.shadows = load_sides(Side::Shadow, &self.empty_shadows, &states);
        self.rollouts = load_sides(Side::Rollout, &self.empty_rollouts, &states);
        self.announce = ends.iter().map(|(k, e)| (k.clone(), e.clone())).collect();
        self.promotions_unrecorded = true;
        self.ends = ends;
        self.cursor = id;
        self.snapshot_taken();
        self.stale_live = true;
        Ok(())
    }

    /// Applies one observation of the stream to the confirmed policies (the live policy and
    /// its shadow; with `rollout`, the rollout's candidate, which learns from its own arm's
    /// observations only); 1 if applied.
    fn apply_observation(
        &mut self,
        state: &dyn SyncTarget,
        (iface, rollout): (&str, bool),
        obs: &Observation,
        own: bool,
    ) -> usize {
        if obs.candidate() >= state.candidate_count(iface) {
            return 0;
        }
        let (policy, shadow) = if rollout {
            (self.rollouts.get_mut(iface), None)
        } else {
            (self.confirmed.get_mut(iface), self.shadows.get_mut(iface))
        };
        let Some(policy) = policy else {
            return 0;
        };
        obs.apply(policy.as_mut());
        if let Some(shadow) = shadow {
            obs.apply(shadow.as_mut());
        }
        self.stale_live |= !own;
        1
    }

    /// A promotion this instance can follow only if it runs the same candidate: its
    /// confirmed live policy becomes the candidate's.
    ///
    /// # Errors
    /// The rollout of `iface` here is missing or tries another policy.
    fn check_end(&self, iface: &str, end: &RolloutEnd) -> Result<(), SharedError> {
        if end.outcome != RolloutOutcome::Promoted || !self.empty.contains_key(iface) {
            return Ok(());
        }
        let here = self.empty_rollouts.get(iface).map(|p| p.kind().as_str());
        if here == Some(end.policy.as_str()) {
            return Ok(());
        }
        Err(SharedError::Mismatch {
            namespace: self.cfg.namespace.clone(),
            reason: format!(
                "interface `{iface}`: its rollout's candidate `{}` was promoted by another instance, and this instance's configuration {}: run the same `rollout` as the other instances",
                end.policy,
                here.map_or("has no rollout".to_owned(), |p| format!("tries `{p}`")),
            ),
        })
    }

    /// Applies a rollout's end from the stream: the first end of an interface's rollout
    /// counts (a later one, decided meanwhile elsewhere, is ignored everywhere alike); a
    /// promotion makes the confirmed candidate the confirmed live policy.
    fn apply_end(&mut self, iface: &str, end: &RolloutEnd, instance: Option<&str>) {
        if self.ends.contains_key(iface) || !self.empty.contains_key(iface) {
            // An own end that lost to an earlier one: the live policy follows the stream's.
            self.stale_live = true;
            return;
        }
        let mut end = end.clone();
        instance.unwrap_or_default().clone_into(&mut end.instance);
        if end.outcome == RolloutOutcome::Promoted {
            if let Some(candidate) = self.rollouts.get(iface) {
                self.confirmed
                    .insert(iface.to_owned(), candidate.clone_box());
            }
            self.promotions_unrecorded = true;
        }
        self.stale_live = true;
        self.announce.push((iface.to_owned(), end.clone()));
        self.ends.insert(iface.to_owned(), end);
    }

    /// Applies one stream entry; returns the number of policy observations in it.
    ///
    /// # Errors
    /// A promotion this instance cannot follow (checked before anything is applied, so the
    /// entry is read again once the configuration is fixed).
    fn apply_entry(
        &mut self,
        state: &dyn SyncTarget,
        fields: &[Vec<u8>],
        report: &mut SyncReport,
    ) -> Result<usize, SharedError> {
        let mut instance = None;
        let mut last_seq = 0;
        let mut batch: Vec<Event> = Vec::new();
        let mut rollout: Vec<Event> = Vec::new();
        let mut ends: Vec<Event> = Vec::new();
        for pair in fields.chunks_exact(2) {
            match pair[0].as_slice() {
                b"i" => instance = Some(String::from_utf8_lossy(&pair[1]).into_owned()),
                b"s" => {
                    last_seq = std::str::from_utf8(&pair[1])
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0);
                }
                b"b" => batch = rmp_serde::from_slice(&pair[1]).unwrap_or_default(),
                b"r" => rollout = rmp_serde::from_slice(&pair[1]).unwrap_or_default(),
                b"e" => ends = rmp_serde::from_slice(&pair[1]).unwrap_or_default(),
                _ => {}
            }
        }
        for event in &ends {
            if let Event::RolloutEnd { iface, end } = event {
                if !self.ends.contains_key(iface) {
                    self.check_end(iface, end)?;
                }
            }
        }
        let own = instance.as_deref() == Some(self.instance.as_str());
        if own {
            self.own_confirmed = self.own_confirmed.max(last_seq);
        }
        let mut observations = 0;
        for event in &batch {
            match event {
                Event::Learn { iface, obs } => {
                    observations += self.apply_observation(state, (iface, false), obs, own);
                }
                Event::Feedback {
                    iface,
                    request_id,
                    obs,
                } => {
                    let at = match obs {
                        Observation::Quality { now, .. }
                        | Observation::Attempt { now, .. }
                        | Observation::Recovered { now, .. } => now.0,
                    };
                    if self
                        .seen
                        .insert(request_id, at, self.seen_horizon, self.seen_cap)
                    {
                        observations += self.apply_observation(state, (iface, false), obs, own);
                    } else {
                        // Scored on two instances without Redis: the first in the stream
                        // counts. This instance's live policies hold its own: rebuild them.
                        self.stale_live |= own;
                        report.duplicate_feedback += 1;
                    }
                    if !own {
                        state.consume_pending(request_id);
                    }
                }
                Event::Pending { request_id, ctx } if !own => {
                    state.insert_pending(request_id, ctx);
                }
                Event::BreakerOpen {
                    iface,
                    candidate,
                    until,
                    pinned,
                } if !own => state.open_breaker(iface, *candidate, *until, *pinned),
                Event::Pending { .. }
                | Event::BreakerOpen { .. }
                | Event::RolloutLearn { .. }
                | Event::RolloutEnd { .. } => {}
            }
        }
        for event in &rollout {
            if let Event::RolloutLearn { iface, obs } = event {
                observations += self.apply_observation(state, (iface, true), obs, own);
            }
        }
        // Last: the candidate's observations of this entry are in before a promotion.
        for event in &ends {
            if let Event::RolloutEnd { iface, end } = event {
                self.apply_end(iface, end, instance.as_deref());
            }
        }
        Ok(observations)
    }

    /// Live policy = confirmed + this instance's observations the log does not hold yet;
    /// the same for the shadows.
    fn rebuild_live(&self, state: &dyn SyncTarget) {
        let Some(shared) = state.shared() else {
            return;
        };
        let rebuilt = |name: &str, rollout: bool, confirmed: &dyn Policy| {
            let mut fresh = confirmed.clone_box();
            shared.journal.replay_after(
                self.own_confirmed,
                (name, rollout),
                fresh.as_mut(),
                &|id| self.seen.contains(id),
            );
            fresh
        };
        for (name, confirmed) in &self.confirmed {
            state.replace_live_policy(name, &mut || rebuilt(name, false, confirmed.as_ref()));
        }
        for (side, map) in self.sides() {
            for (name, p) in map {
                state.replace_side_policy(side, name, &mut || {
                    rebuilt(name, side == Side::Rollout, p.as_ref())
                });
            }
        }
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

/// Side policies of `side` from a snapshot's `states`, each started from its `empty` copy.
/// A snapshot written before side policies were shared, or by an instance without this one,
/// has none; one of another policy is skipped with a warning: the side policy then learns
/// from the stream after the snapshot.
fn load_sides(
    side: Side,
    empty: &BTreeMap<String, Box<dyn Policy>>,
    states: &BTreeMap<String, PolicyState>,
) -> BTreeMap<String, Box<dyn Policy>> {
    empty
        .iter()
        .map(|(name, empty)| {
            let mut fresh = empty.clone_box();
            if let Some(s) = states.get(&side.key(name)) {
                if let Err(e) = fresh.merge_state(s) {
                    tracing::warn!(
                        interface = %name,
                        side = ?side,
                        error = %e,
                        "the shared snapshot's state of this side policy is of another policy: it learns from the stream after the snapshot"
                    );
                    fresh = empty.clone_box();
                }
            }
            (name.clone(), fresh)
        })
        .collect()
}

/// The client of `cfg`'s URL (the error never shows the URL: it may hold a password).
fn client(cfg: &RedisStateConfig) -> Result<redis::Client, SharedError> {
    redis::Client::open(cfg.url.0.as_str())
        .map_err(|_| SharedError::Redis("state.url is not a valid redis:// URL".into()))
}

/// Deletes every key of the namespace (for `serve --reset-state`), unless an instance of
/// it is live: a running instance holds the learning in memory and would write it back at
/// its next sync, so the reset would do nothing.
///
/// # Errors
/// [`SharedError::Live`] while an instance syncs with the namespace (nothing is deleted);
/// Redis is unreachable.
pub async fn reset(cfg: &RedisStateConfig) -> Result<(), SharedError> {
    let mut conn = timed(client(cfg)?.get_multiplexed_async_connection()).await?;
    let keys = Keys::new(&cfg.namespace);
    let live: Vec<String> = timed(
        redis::Script::new(RESET_SCRIPT)
            .key(&keys.live)
            .key(&keys.log)
            .key(&keys.acks)
            .key(&keys.snapshot)
            .key(&keys.meta)
            .key(&keys.epoch)
            .key(&keys.promoted)
            .invoke_async(&mut conn),
    )
    .await?;
    if live.is_empty() {
        return Ok(());
    }
    Err(SharedError::Live {
        namespace: cfg.namespace.clone(),
        count: live.len(),
        forgotten_s: live_for(cfg.sync_interval).as_secs(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seen_feedback_ids_are_bounded_by_age_and_count_and_survive_a_snapshot() {
        let mut seen = SeenFeedback::default();
        // Horizon 100 ms, at most 3 ids.
        assert!(seen.insert("r1", 0.0, 100.0, 3));
        assert!(
            !seen.insert("r1", 50.0, 100.0, 3),
            "a second score is a duplicate"
        );
        assert!(seen.insert("r2", 60.0, 100.0, 3));
        // r1 (scored at 0) is more than 100 ms older than the newest score (150): forgotten.
        assert!(seen.insert("r3", 150.0, 100.0, 3));
        assert!(!seen.contains("r1") && seen.contains("r2") && seen.contains("r3"));
        // Count: a fourth id evicts the oldest beyond 3.
        assert!(seen.insert("r4", 151.0, 100.0, 3));
        assert!(seen.insert("r5", 152.0, 100.0, 3));
        assert_eq!(seen.order.len(), 3);
        assert!(!seen.contains("r2") && seen.contains("r5"));
        let bytes = rmp_serde::to_vec_named(&seen).unwrap_or_default();
        let back = SeenFeedback::from_bytes(Some(&bytes)).unwrap_or_default();
        assert!(back.contains("r3") && back.contains("r4") && !back.contains("r2"));
        assert!((back.newest - 152.0).abs() < 1e-12, "{}", back.newest);
    }
}
