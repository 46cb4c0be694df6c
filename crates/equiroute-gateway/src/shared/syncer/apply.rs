//! The confirmed state follows the stream: each entry's observations, feedback, contexts,
//! breakers and rollout ends applied in the stream's order, and the live policies rebuilt from
//! it.

use super::{Side, SyncReport, SyncTarget, Syncer};
use crate::shared::journal::{Event, RolloutEnd, RolloutOutcome};
use crate::shared::namespace::{timed, SharedError};
use equiroute_core::policies::{Observation, Policy};
use redis::aio::MultiplexedConnection;

impl Syncer {
    /// Hands the rollouts' ends confirmed since the last sync to the gateway, after writing
    /// the promotions among the ends into the namespace's hash (the same values from every
    /// instance: the first end in the stream holds).
    pub(super) async fn apply_ends(
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
    pub(super) fn check_end(&self, iface: &str, end: &RolloutEnd) -> Result<(), SharedError> {
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
    pub(super) fn apply_entry(
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
    pub(super) fn rebuild_live(&self, state: &dyn SyncTarget) {
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
}
