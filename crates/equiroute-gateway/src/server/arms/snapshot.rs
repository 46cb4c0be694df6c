//! The side policies in the state file: what is saved of the shadow and the rollout, and
//! how a saved rollout is restored (or refused, when the configuration changed).

use super::{Arms, RolloutStatus};
use crate::server::error::Poisoned;
use equiroute_core::policies::Policy;
use equiroute_core::sequential::BoundedMean;
use std::sync::atomic::Ordering;

/// The side policies' state in a snapshot of the state file: the shadow's learning, and the
/// rollout's policy, measurements and state, so that a restart neither starts a rolled-back
/// canary again nor loses a promotion. Snapshots written before it existed have none.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ArmsSnapshot {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<equiroute_core::policies::PolicyState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSnapshot>,
}

/// A rollout as saved.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct RolloutSnapshot {
    /// The candidate policy's name: a saved rollout is restored only into a rollout of the
    /// same policy.
    pub policy: String,
    /// `running`, `rolled_back`, `promoted` or `aborted`.
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_unix_ms: Option<f64>,
    pub bad: [BoundedMean; 2],
    pub unquality: [BoundedMean; 2],
    pub state: equiroute_core::policies::PolicyState,
}

/// What restoring a saved rollout asks of the caller.
#[derive(Debug, PartialEq, Eq)]
pub enum Restored {
    /// Nothing: the live policy's saved state goes into the live policy as usual.
    Nothing,
    /// The rollout had been promoted: the live policy is the candidate's, and the saved live
    /// state belongs to it.
    Promoted,
}

impl Arms {
    /// The side policies' state for a snapshot (`None` when there are none).
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn export(&self) -> Result<Option<ArmsSnapshot>, Poisoned> {
        let shadow = match &self.shadow {
            Some(s) => Some(s.policy.write()?.export_state()),
            None => None,
        };
        let rollout = match &self.rollout {
            Some(r) => {
                let state = r.policy.write()?.export_state();
                let stats = r.stats.lock().map_err(|_| Poisoned)?;
                let (metric, at) = match &stats.status {
                    RolloutStatus::Running => (None, None),
                    RolloutStatus::RolledBack {
                        metric, at_unix_ms, ..
                    } => (Some((*metric).to_owned()), Some(*at_unix_ms)),
                    RolloutStatus::Promoted { at_unix_ms }
                    | RolloutStatus::Aborted { at_unix_ms } => (None, Some(*at_unix_ms)),
                };
                Some(RolloutSnapshot {
                    policy: r.policy.kind.as_str().to_owned(),
                    status: stats.status.name().to_owned(),
                    metric,
                    at_unix_ms: at,
                    bad: stats.bad,
                    unquality: stats.unquality,
                    state,
                })
            }
            None => None,
        };
        Ok((shadow.is_some() || rollout.is_some()).then_some(ArmsSnapshot { shadow, rollout }))
    }

    /// Restores saved side policies into those the configuration has: the shadow's state when
    /// the shadow is the same policy, the rollout's status, measurements and state when the
    /// rollout tries the same policy (a rolled-back, aborted or promoted one stays ended). A
    /// promoted rollout makes `live` a fresh copy of the candidate, for the caller to fill
    /// with the saved live state. Side policies the configuration changed start afresh.
    ///
    /// # Errors
    /// A saved state that does not fit the policy (another shape of interface), or a poisoned
    /// lock.
    pub fn restore(
        &self,
        iface: &str,
        saved: &ArmsSnapshot,
        live: &mut Box<dyn Policy>,
    ) -> Result<Restored, String> {
        if let (Some(state), Some(shadow)) = (&saved.shadow, &self.shadow) {
            if state.kind() == shadow.policy.kind {
                shadow
                    .policy
                    .write()
                    .map_err(|_| "poisoned".to_owned())?
                    .merge_state(state)
                    .map_err(|e| format!("the shadow: {e}"))?;
            }
        }
        let (Some(saved), Some(r)) = (&saved.rollout, &self.rollout) else {
            return Ok(Restored::Nothing);
        };
        if saved.policy != r.policy.kind.as_str() {
            tracing::info!(
                interface = iface,
                saved = saved.policy,
                configured = r.policy.kind.as_str(),
                "the saved rollout tried another policy: this one starts afresh"
            );
            return Ok(Restored::Nothing);
        }
        let mut restored = Restored::Nothing;
        {
            let mut candidate = r.policy.write().map_err(|_| "poisoned".to_owned())?;
            if saved.status == "promoted" {
                // Still fresh: the promoted policy's learning is the saved live state.
                *live = candidate.clone_box();
                restored = Restored::Promoted;
            }
            candidate
                .merge_state(&saved.state)
                .map_err(|e| format!("the rollout's candidate: {e}"))?;
        }
        let at_unix_ms = saved.at_unix_ms.unwrap_or(0.0);
        let mut stats = r.stats.lock().map_err(|_| "poisoned".to_owned())?;
        stats.bad = saved.bad;
        stats.unquality = saved.unquality;
        stats.status = match saved.status.as_str() {
            "running" => RolloutStatus::Running,
            "promoted" => RolloutStatus::Promoted { at_unix_ms },
            "aborted" => RolloutStatus::Aborted { at_unix_ms },
            _ => {
                let metric = if saved.metric.as_deref() == Some("quality") {
                    "quality"
                } else {
                    "bad_rate"
                };
                let evidence = r
                    .comparisons(&stats)
                    .into_iter()
                    .find(|(m, _)| *m == metric)
                    .map(|(_, c)| c)
                    .ok_or_else(|| "no guard for the saved metric".to_owned())?;
                RolloutStatus::RolledBack {
                    metric,
                    evidence,
                    at_unix_ms,
                }
            }
        };
        let running = stats.status == RolloutStatus::Running;
        r.active.store(running, Ordering::Relaxed);
        if restored == Restored::Promoted {
            self.set_live(r.policy.kind);
        }
        if !running {
            tracing::warn!(
                interface = iface,
                candidate = saved.policy,
                status = saved.status,
                "the saved rollout had ended: it stays ended (remove `rollout` from the interface's configuration{})",
                if restored == Restored::Promoted {
                    " and set its `policy` to the promoted one"
                } else {
                    ""
                }
            );
        }
        Ok(restored)
    }
}
