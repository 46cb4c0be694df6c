//! The request ids whose score the confirmed state holds ([`SeenFeedback`]), so that a second
//! score for one request is skipped alike on every instance.

use crate::shared::namespace::SharedError;
use serde::{Deserialize, Serialize};
use std::collections::{HashSet, VecDeque};

/// Request ids whose score the confirmed state holds, oldest first. A second score for one
/// (two instances that each accepted it while Redis was unreachable) is skipped in the
/// stream's order, so every instance counts the first one only; snapshots carry the set,
/// since it is part of the confirmed state. Bounded the same way on every instance: ids are
/// kept while scored within `horizon` (twice the feedback window) of the newest score — a
/// request's scores all arrive within one window of its answer — and at most `cap` of them
/// (the pending store's size: no instance holds more contexts that could still be scored).
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct SeenFeedback {
    order: VecDeque<(String, f64)>,
    newest: f64,
    #[serde(skip)]
    ids: HashSet<String>,
}

impl SeenFeedback {
    /// Records `id`, scored at `at` (ms); false when it is recorded already.
    pub(super) fn insert(&mut self, id: &str, at: f64, horizon: f64, cap: usize) -> bool {
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

    pub(super) fn contains(&self, id: &str) -> bool {
        self.ids.contains(id)
    }

    /// The set stored with a snapshot (empty when the snapshot has none: older releases).
    pub(super) fn from_bytes(bytes: Option<&[u8]>) -> Result<SeenFeedback, SharedError> {
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
