//! Snapshots and epochs: the confirmed state loaded from the stored snapshot, and a stream that
//! Redis lost re-seeded from this instance or re-based on another's.

use super::seen::SeenFeedback;
use super::{Side, SyncReport, Syncer};
use crate::shared::handle::SharedHandle;
use crate::shared::journal::{RolloutEnd, RolloutOutcome};
use crate::shared::namespace::{redis_err, timed, SharedError, StreamId, RESEED_ID};
use equiroute_core::policies::{Policy, PolicyState};
use redis::aio::MultiplexedConnection;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

impl Syncer {
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

    /// A snapshot stands at (or past) the cursor: the count towards the next compaction
    /// starts again.
    pub(super) fn snapshot_taken(&mut self) {
        self.since_snapshot = 0;
        self.since_snapshot_bytes = 0;
    }

    /// Compares the stream's `epoch` with the one this instance knew, and recovers when
    /// Redis lost the stream; true when it did (the snapshot read before is stale then).
    pub(super) async fn check_epoch(
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

    /// Replaces the confirmed policies with the stored snapshot.
    pub(super) async fn load_snapshot(
        &mut self,
        conn: &mut MultiplexedConnection,
    ) -> Result<(), SharedError> {
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
