//! What the rest of the gateway holds of the shared state ([`SharedHandle`]): the journal, the
//! sync status with its metrics and readiness, and the feedback claims.

use super::claims::Claims;
use super::journal::Journal;
use super::namespace::Keys;
use crate::config::RedisStateConfig;
use equiroute_core::Timestamp;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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
    /// Prefix of the providers' shared capacity counts (`{ns}:cap:`).
    pub(super) quotas: String,
}

impl SharedHandle {
    /// The hooks of an instance configured by `cfg`.
    #[must_use]
    pub fn new(cfg: &RedisStateConfig) -> SharedHandle {
        SharedHandle {
            journal: Journal::new(cfg.max_unpushed),
            status: SyncStatus::default(),
            claims: Claims::new(Keys::new(&cfg.namespace).claims, cfg.claim_timeout),
            quotas: Keys::new(&cfg.namespace).quotas,
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
