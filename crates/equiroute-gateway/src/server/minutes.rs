//! The operations view's minute rings ([`super::ops`]) in the state file: written beside the
//! learning snapshot (by the state file's writer), restored at start for the interfaces of
//! the same providers. A record of another version, or one that cannot be read, starts the
//! view empty.

use super::ops::{Saved, SAVED_VERSION};
use super::state::AppState;

/// The minute rings of every interface of `state`, for the state file: the live bins of the
/// last 24 hours (bounded by the rings' fixed size).
#[must_use]
pub fn saved(state: &AppState) -> Option<Vec<u8>> {
    let now = state.now();
    let interfaces = state
        .interfaces()
        .iter()
        .filter_map(|(name, iface)| {
            let ids: Vec<String> = iface.candidates.iter().map(|c| c.id.0.clone()).collect();
            Some((name.clone(), iface.history.save_minutes(now, &ids)?))
        })
        .collect();
    serde_json::to_vec(&Saved {
        version: SAVED_VERSION,
        interfaces,
    })
    .ok()
}

/// Takes the minute rings saved in `bytes` into `state`'s interfaces (those of the same
/// providers); returns the bins taken. A record of another version, or one that cannot be
/// read, is left out: the view then starts empty.
#[must_use]
pub fn restore(state: &AppState, bytes: &[u8]) -> usize {
    let Ok(saved) = serde_json::from_slice::<Saved>(bytes) else {
        return 0;
    };
    if saved.version != SAVED_VERSION {
        return 0;
    }
    saved
        .interfaces
        .iter()
        .filter_map(|(name, ring)| {
            let iface = state.interface(name)?;
            let ids: Vec<String> = iface.candidates.iter().map(|c| c.id.0.clone()).collect();
            Some(iface.history.restore_minutes(ring, &ids))
        })
        .sum()
}
