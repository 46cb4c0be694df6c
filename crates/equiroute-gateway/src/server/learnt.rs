//! One interface's learnt state as a value: what the state file saves of each interface, and
//! what a reload carries from an interface's old runtime to its new one.

use super::state::{AppState, InterfaceRuntime};
use equiroute_core::breaker::Breaker;
use equiroute_core::policies::PolicyState;
use serde::{Deserialize, Serialize};

/// One interface's learnt state: its live policy's statistics, its breakers and its side
/// policies', under the ids of the providers they belong to.
#[derive(Debug, Serialize, Deserialize)]
pub struct InterfaceSnapshot {
    /// The provider ids, in the interface's order: the policy's and the breakers' indices.
    pub candidates: Vec<String>,
    pub policy: PolicyState,
    pub breakers: Vec<Breaker>,
    /// The shadow's and the rollout's state (absent in snapshots written before them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arms: Option<super::arms::ArmsSnapshot>,
}

impl InterfaceSnapshot {
    /// What `iface` has learnt now (the observations queued for its policy applied first);
    /// `None` when its policy's lock is poisoned (poisoned breakers are saved as none).
    #[must_use]
    pub fn of(state: &AppState, iface: &InterfaceRuntime) -> Option<InterfaceSnapshot> {
        let policy = state.policy_mut(iface).ok()?.export_state();
        Some(InterfaceSnapshot {
            candidates: iface.candidates.iter().map(|c| c.id.0.clone()).collect(),
            policy,
            breakers: iface.breakers.lock().map(|b| b.clone()).unwrap_or_default(),
            arms: iface.arms.export().ok().flatten(),
        })
    }

    /// Loads this state into `iface`, the fresh runtime of the interface `name` (its policy
    /// from priors), or says why `iface` cannot take it: other providers (ids or order), or
    /// another policy.
    ///
    /// # Errors
    /// Why the state does not fit; `iface` may then hold part of it (build it again).
    pub fn restore(&self, name: &str, iface: &InterfaceRuntime) -> Result<(), String> {
        let ids: Vec<String> = iface.candidates.iter().map(|c| c.id.0.clone()).collect();
        if ids != self.candidates {
            return Err(format!(
                "interface `{name}` had providers {:?} and now has {ids:?}",
                self.candidates
            ));
        }
        let mut policy = iface
            .policy
            .write()
            .map_err(|_| "policy lock poisoned".to_owned())?;
        // A promoted rollout makes the live policy the candidate's first.
        if let Some(arms) = &self.arms {
            iface
                .arms
                .restore(name, arms, &mut policy)
                .map_err(|e| format!("interface `{name}`: {e}"))?;
        }
        policy
            .merge_state(&self.policy)
            .map_err(|e| format!("interface `{name}`: {e}"))?;
        if let Ok(mut b) = iface.breakers.lock() {
            if b.len() == self.breakers.len() {
                b.clone_from(&self.breakers);
            }
        }
        Ok(())
    }
}
