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
//!
//! # Where it lives
//!
//! `journal` (what travels, and the journal), `claims` (the feedback claims), `quotas` (the
//! providers' capacity counted across instances, `server::capacity`), `namespace` (keys,
//! Lua scripts, errors, [`reset`]), `handle` (what the rest of the gateway holds), and `syncer`
//! (the background task; `push`, `apply` and `snapshot` are its steps, `seen` the scored ids).

mod claims;
mod handle;
mod journal;
mod namespace;
mod quotas;
mod syncer;

pub use claims::{Claim, Claims};
pub use handle::{SharedHandle, SyncStatus};
pub use journal::{Event, Journal, RolloutEnd, RolloutOutcome};
pub use namespace::{reset, SharedError, StreamId, RECOVER_SCRIPT};
pub use quotas::SharedTake;
pub use syncer::{Side, SyncReport, SyncTarget, SyncedInterface, Syncer};
