//! What an instance learns, as it travels through Redis ([`Event`], [`RolloutEnd`]), and the
//! [`Journal`] of its own events that the shared log does not hold yet.

use crate::pending::PendingFeedback;
use equiroute_core::policies::{Observation, Policy};
use equiroute_core::Timestamp;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Mutex;

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
    pub(super) fn after(&self, seq: u64, limit: usize) -> Vec<(u64, Event)> {
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
    pub(super) fn replay_after(
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
    pub(super) fn forget_through(&self, seq: u64) {
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
