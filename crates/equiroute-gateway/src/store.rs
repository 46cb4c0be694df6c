//! Learning state that survives restarts: every interface's policy statistics and breakers,
//! and the contexts of answered requests still waiting for quality feedback, saved as one
//! snapshot in an embedded redb file.
//!
//! Why redb: a pure-Rust embedded store (no C library to build), with ACID write
//! transactions whose commit is crash-safe — a `kill -9` at any moment leaves either the
//! previous snapshot or the new one, never a torn file. The snapshot is versioned
//! ([`SCHEMA`]); a file from another schema, another policy or another set of providers is
//! refused with a clear error and the way out (`equiroute serve --reset-state`), never
//! wiped silently.

use crate::server::state::{AppState, PendingFeedback};
use equiroute_core::breaker::Breaker;
use equiroute_core::policies::PolicyState;
use redb::{Database, ReadableDatabase, TableDefinition};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Version of the snapshot format.
pub const SCHEMA: u32 = 1;

const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const KEY: &str = "gateway";

/// Where state is kept and how often it is saved.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    pub path: PathBuf,
    /// Seconds between snapshots (also saved on shutdown).
    #[serde(default = "default_interval")]
    pub snapshot_interval_s: f64,
}

fn default_interval() -> f64 {
    5.0
}

/// A state file that cannot be used, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state file {path}: {reason}. Fix: move it aside, or start with `equiroute serve --reset-state` to begin from empty statistics")]
    Unusable { path: String, reason: String },
    #[error("state file {path}: cannot write the snapshot: {reason}")]
    Write { path: String, reason: String },
}

/// One interface's saved learning state.
#[derive(Debug, Serialize, Deserialize)]
struct InterfaceSnapshot {
    candidates: Vec<String>,
    policy: PolicyState,
    breakers: Vec<Breaker>,
}

/// Everything saved.
#[derive(Debug, Serialize, Deserialize)]
struct Snapshot {
    schema: u32,
    interfaces: BTreeMap<String, InterfaceSnapshot>,
    pending: Vec<(String, PendingFeedback)>,
}

/// The embedded store.
pub struct Store {
    db: Database,
    path: String,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.path)
    }
}

impl Store {
    /// Opens (or creates) the state file.
    ///
    /// # Errors
    /// The file is not a redb database or cannot be opened.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let shown = path.display().to_string();
        let db = Database::create(path).map_err(|e| StoreError::Unusable {
            path: shown.clone(),
            reason: format!("cannot be opened as an Equiroute state file ({e})"),
        })?;
        Ok(Store { db, path: shown })
    }

    fn unusable(&self, reason: impl Into<String>) -> StoreError {
        StoreError::Unusable {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    /// Saves the learning state of `state` in one atomic transaction.
    ///
    /// # Errors
    /// The write or commit failed (the previous snapshot stays intact).
    pub fn save(&self, state: &AppState) -> Result<(), StoreError> {
        let write_err = |e: &dyn std::fmt::Display| StoreError::Write {
            path: self.path.clone(),
            reason: e.to_string(),
        };
        let bytes = serde_json::to_vec(&snapshot(state)).map_err(|e| write_err(&e))?;
        let txn = self.db.begin_write().map_err(|e| write_err(&e))?;
        {
            let mut table = txn.open_table(SNAPSHOTS).map_err(|e| write_err(&e))?;
            table
                .insert(KEY, bytes.as_slice())
                .map_err(|e| write_err(&e))?;
        }
        txn.commit().map_err(|e| write_err(&e))
    }

    /// The last snapshot as JSON (for `equiroute state export`), if there is one.
    ///
    /// # Errors
    /// The file cannot be read.
    pub fn export_json(&self) -> Result<Option<serde_json::Value>, StoreError> {
        let Some(bytes) = self.read_raw()? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| self.unusable(format!("the snapshot cannot be read ({e})")))
    }

    /// Replaces the snapshot with `json` (for `equiroute state import`), after checking that
    /// it is a snapshot of this schema.
    ///
    /// # Errors
    /// Not a snapshot, another schema, or the write failed.
    pub fn import_json(&self, json: &serde_json::Value) -> Result<(), StoreError> {
        let snap: Snapshot = self.decode(
            serde_json::from_value(json.clone())
                .map_err(|e| format!("the imported file is not an Equiroute state snapshot ({e})")),
            "the imported snapshot has",
        )?;
        let bytes = serde_json::to_vec(&snap).map_err(|e| self.unusable(e.to_string()))?;
        self.write_raw(&bytes)
    }

    /// A parsed snapshot of this build's schema, or why it is unusable (`what` starts the
    /// schema message: "it has", "the imported snapshot has").
    fn decode(&self, parsed: Result<Snapshot, String>, what: &str) -> Result<Snapshot, StoreError> {
        let snap = parsed.map_err(|reason| self.unusable(reason))?;
        if snap.schema != SCHEMA {
            return Err(self.unusable(format!(
                "{what} schema version {} and this build reads version {SCHEMA}",
                snap.schema
            )));
        }
        Ok(snap)
    }

    fn read_raw(&self) -> Result<Option<Vec<u8>>, StoreError> {
        let txn = self
            .db
            .begin_read()
            .map_err(|e| self.unusable(e.to_string()))?;
        let table = match txn.open_table(SNAPSHOTS) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(self.unusable(e.to_string())),
        };
        let value = table.get(KEY).map_err(|e| self.unusable(e.to_string()))?;
        Ok(value.map(|v| v.value().to_vec()))
    }

    fn write_raw(&self, bytes: &[u8]) -> Result<(), StoreError> {
        let write_err = |e: &dyn std::fmt::Display| StoreError::Write {
            path: self.path.clone(),
            reason: e.to_string(),
        };
        let txn = self.db.begin_write().map_err(|e| write_err(&e))?;
        {
            let mut table = txn.open_table(SNAPSHOTS).map_err(|e| write_err(&e))?;
            table.insert(KEY, bytes).map_err(|e| write_err(&e))?;
        }
        txn.commit().map_err(|e| write_err(&e))
    }

    /// Restores the last snapshot into `state` (built from the current configuration).
    /// Returns whether there was one.
    ///
    /// # Errors
    /// A snapshot of another schema, of other providers or policies, or unreadable.
    pub fn restore(&self, state: &AppState) -> Result<bool, StoreError> {
        let Some(bytes) = self.read_raw()? else {
            return Ok(false);
        };
        let snap: Snapshot = self.decode(
            serde_json::from_slice(&bytes)
                .map_err(|e| format!("the snapshot cannot be read ({e})")),
            "it has",
        )?;
        for (name, saved) in &snap.interfaces {
            let Some(iface) = state.interfaces.get(name) else {
                continue;
            };
            let ids: Vec<String> = iface.candidates.iter().map(|c| c.id.0.clone()).collect();
            if ids != saved.candidates {
                return Err(self.unusable(format!(
                    "interface `{name}` had providers {:?} and now has {ids:?}",
                    saved.candidates
                )));
            }
            let mut policy = iface
                .policy
                .write()
                .map_err(|_| self.unusable("policy lock poisoned"))?;
            policy
                .merge_state(&saved.policy)
                .map_err(|e| self.unusable(format!("interface `{name}`: {e}")))?;
            if let Ok(mut b) = iface.breakers.lock() {
                if b.len() == saved.breakers.len() {
                    b.clone_from(&saved.breakers);
                }
            }
        }
        if let Ok(mut pending) = state.pending.lock() {
            for (id, entry) in &snap.pending {
                pending.insert(id, entry);
            }
        }
        Ok(true)
    }
}

fn snapshot(state: &AppState) -> Snapshot {
    let mut interfaces = BTreeMap::new();
    for (name, iface) in &state.interfaces {
        let Ok(policy) = state.policy_mut(iface).map(|p| p.export_state()) else {
            continue;
        };
        let breakers = iface.breakers.lock().map(|b| b.clone()).unwrap_or_default();
        interfaces.insert(
            name.clone(),
            InterfaceSnapshot {
                candidates: iface.candidates.iter().map(|c| c.id.0.clone()).collect(),
                policy,
                breakers,
            },
        );
    }
    let pending = state
        .pending
        .lock()
        .map(|p| p.iter().filter(|(_, e)| !e.consumed).collect())
        .unwrap_or_default();
    Snapshot {
        schema: SCHEMA,
        interfaces,
        pending,
    }
}
