//! What operators see of a quality shift the live policy detected (`lqm-ts`'s `shift`
//! detector, [`Policy::take_quality_shifts`]): one `warn` line per shift ("quality of a on chat
//! fell from 0.86 to 0.41 over the last 6 scores"), the counter
//! `equiroute_quality_shifts_total{interface,provider,direction}`, a `"kind": "quality_shift"`
//! line in the audit log when one is configured, and the interface's last shifts on the
//! dashboard.
//!
//! Everything in them is the gateway's own: configured interface and provider names, the
//! direction and numbers; nothing a client sent. Shifts are drained under the policy's write
//! lock right after the observation that set them off, so each is reported once, by the
//! instance that learnt it (a policy rebuilt from the shared journal drops the shifts its
//! replay found: [`discard`]).

use super::state::{AppState, InterfaceRuntime};
use equiroute_core::policies::{Policy, QualityShift, ShiftDirection};
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

/// The verb of the log line.
fn verb(direction: ShiftDirection) -> &'static str {
    match direction {
        ShiftDirection::Down => "fell",
        ShiftDirection::Up => "rose",
    }
}

/// Reports the shifts `policy` (the interface's live policy, under its write lock) detected
/// since the last call.
pub fn report(state: &AppState, iface: &InterfaceRuntime, policy: &mut dyn Policy) {
    for shift in policy.take_quality_shifts() {
        report_one(state, iface, &shift);
    }
}

/// Drops the shifts a policy rebuilt from the shared journal found in its replay: the
/// instances that learnt those scores reported them.
pub fn discard(policy: &mut dyn Policy) {
    let _ = policy.take_quality_shifts();
}

fn report_one(state: &AppState, iface: &InterfaceRuntime, shift: &QualityShift) {
    let Some(candidate) = iface.candidates.get(shift.candidate) else {
        return;
    };
    let provider = candidate.id.0.as_str();
    let direction = shift.direction.as_str();
    state
        .metrics
        .quality_shift(&iface.name, provider, direction);
    // Scores are posted by clients: a client can set shifts off at will, so the line is
    // rate-limited like the others a client can trigger (the counter counts every one).
    if state.logs.allow(super::repeated::Repeated::QualityShift) {
        tracing::warn!(
            interface = %iface.name,
            provider,
            direction,
            from = shift.from,
            to = shift.to,
            scores = shift.scores,
            "quality of {provider} on {} {} from {:.2} to {:.2} over the last {} scores",
            iface.name,
            verb(shift.direction),
            shift.from,
            shift.to,
            shift.scores,
        );
    }
    let record = ShiftRecord {
        kind: "quality_shift",
        ts_ms: shift.at.0,
        interface: iface.name.clone(),
        provider: provider.to_owned(),
        direction,
        from: shift.from,
        to: shift.to,
        scores: shift.scores,
    };
    iface.history.shift(&record);
    if let Some(audit) = &state.audit {
        audit.quality_shift(record);
    }
}
