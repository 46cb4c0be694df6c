//! What operators see of a quality shift the live policy detected (`lqm-ts`'s `shift`
//! detector, [`Policy::take_quality_shifts`]): one `warn` line per shift ("quality of a on chat
//! fell from 0.86 to 0.41 over the last 6 scores"), the counter
//! `equiroute_quality_shifts_total{interface,provider,direction}`, a `"kind": "quality_shift"`
//! line in the audit log when one is configured, and the interface's last shifts on the
//! dashboard. The ledger reports them (`super::book`); this module owns their record.
//!
//! Everything in them is the gateway's own: configured interface and provider names, the
//! direction and numbers; nothing a client sent. Shifts are drained under the policy's write
//! lock right after the observation that set them off, so each is reported once, by the
//! instance that learnt it (a policy rebuilt from the shared journal drops the shifts its
//! replay found: [`discard`]).

use equiroute_core::policies::{Policy, QualityShift};
use serde::Serialize;

/// A detected shift as the audit log and the dashboard keep it (`"kind": "quality_shift"`).
#[derive(Clone, Debug, Serialize)]
pub struct ShiftRecord {
    pub kind: &'static str,
    /// When the score that set it off was learnt (Unix ms).
    pub ts_ms: f64,
    pub interface: String,
    pub provider: String,
    /// `down` or `up`.
    pub direction: &'static str,
    /// The provider's mean score before the change.
    pub from: f64,
    /// The mean of the scores since the change's estimated start.
    pub to: f64,
    /// How many scores that is: the evidence kept, everything before it discarded.
    pub scores: u64,
}

impl ShiftRecord {
    /// The record of `shift`, detected on `provider` of `interface`.
    #[must_use]
    pub fn of(interface: &str, provider: &str, shift: &QualityShift) -> ShiftRecord {
        ShiftRecord {
            kind: "quality_shift",
            ts_ms: shift.at.0,
            interface: interface.to_owned(),
            provider: provider.to_owned(),
            direction: shift.direction.as_str(),
            from: shift.from,
            to: shift.to,
            scores: shift.scores,
        }
    }
}

/// Drops the shifts a policy rebuilt from the shared journal found in its replay: the
/// instances that learnt those scores reported them.
pub fn discard(policy: &mut dyn Policy) {
    let _ = policy.take_quality_shifts();
}
