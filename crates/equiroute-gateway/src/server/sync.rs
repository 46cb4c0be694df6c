//! How the Redis syncer ([`crate::shared`]) reaches this gateway's state: the
//! [`SyncTarget`](crate::shared::SyncTarget) of [`AppState`], which rebuilds policies from the
//! shared journal, inserts and consumes other instances' pending contexts, and applies their
//! breaker openings and rollout ends.

use super::state::{AppState, PendingFeedback};
use equiroute_core::policies::Policy;
use equiroute_core::{Millis, Timestamp};

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
        self.interfaces()
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
        self.interface(iface).map_or(0, |i| i.candidates.len())
    }

    fn replace_live_policy(&self, iface: &str, rebuild: &mut dyn FnMut() -> Box<dyn Policy>) {
        let Some(iface) = self.interface(iface) else {
            return;
        };
        let Ok(mut live) = self.policy_mut(&iface) else {
            return;
        };
        *live = rebuild();
        super::shifts::discard(live.as_mut());
    }

    fn replace_side_policy(
        &self,
        side: crate::shared::Side,
        iface: &str,
        rebuild: &mut dyn FnMut() -> Box<dyn Policy>,
    ) {
        let Some(iface) = self.interface(iface) else {
            return;
        };
        let arms = &iface.arms;
        let policy = match side {
            crate::shared::Side::Shadow => arms.shadow.as_ref().map(|s| &s.policy),
            crate::shared::Side::Rollout => arms.rollout.as_ref().map(|r| &r.policy),
        };
        let Some(Ok(mut policy)) = policy.map(super::arms::SidePolicy::write) else {
            return;
        };
        *policy = rebuild();
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
        if let Some(i) = self.interface(iface) {
            i.arms.apply_shared_end(iface, end, own);
        }
    }

    fn now(&self) -> Timestamp {
        AppState::now(self)
    }
}
