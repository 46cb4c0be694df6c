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
//!
//! A file is checked before it is trusted: redb's plain open trusts a file it shut down
//! cleanly and panics on one damaged since, so every open first runs redb's integrity check
//! (every page's checksum) on a copy in memory, under the file's own locks ([`Scratch`]). A
//! damaged file is refused untouched, and one that another process holds is reported as held
//! ([`StoreError::Locked`]), never as damaged: deleting it would split the learning in two.
//!
//! Refused means untouched: the gateway restores the snapshot it checked before it opens the
//! file for writing ([`Store::open_restoring`]), and `state import` checks the imported
//! snapshot against the configuration as start-up would before it opens the file
//! ([`Store::import_file`]), so a file of another configuration, or a live file under a bad
//! import, keeps its bytes and its modification time.
//!
//! A failed write (a full disk) leaves redb refusing every later one ("Previous I/O error
//! occurred"); [`Store::save`] then drops the database and opens the file again at the next
//! save, so snapshots resume once the cause is gone.

use crate::server::learnt::InterfaceSnapshot;
use crate::server::state::{AppState, PendingFeedback};
use redb::backends::FileBackend;
use redb::{Builder, Database, DatabaseError, ReadableDatabase, StorageBackend, TableDefinition};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Version of the snapshot format.
pub const SCHEMA: u32 = 1;

const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const KEY: &str = "gateway";
/// The operations view's minute rings (`server::ops`); one unreadable is left out, never refused.
const MINUTES_KEY: &str = "operations-minutes";

pub use crate::config::StoreConfig;

/// A state file that cannot be used, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state file {path}: {reason}. Fix: move it aside, or start with `equiroute serve --reset-state` to begin from empty statistics")]
    Unusable { path: String, reason: String },
    /// Another open of the file holds its lock: the file is fine, and deleting it would split
    /// the learning between the holder and this process.
    #[error("state file {path} is in use by {holder}: a gateway holds its state file while it runs. Stop that one first, give each gateway a `[state] path` of its own, or start this one with `equiroute serve --in-memory`; the file is not damaged, do not delete it")]
    Locked { path: String, holder: String },
    /// `state export` of a file that does not exist or holds no snapshot yet.
    #[error("no state saved yet at {path}")]
    NothingSaved { path: String },
    /// The file exists but cannot be opened (permissions, a read-only mount, I/O): nothing
    /// is wrong with its content as far as anyone knows, so the advice never deletes it.
    #[error("state file {path}: cannot open it: {reason}. Fix: let this user read and write the file and its directory (a gateway writes its snapshots there), or point `[state] path` at a writable place; the file is not known to be damaged, do not delete it")]
    Io { path: String, reason: String },
    #[error("state file {path}: cannot write the snapshot: {reason}")]
    Write {
        path: String,
        reason: String,
        /// Why, in a word from a fixed set (the `/metrics` label).
        cause: WriteFailure,
    },
    /// `state import` of a snapshot this configuration cannot load: the state file is left
    /// as it was, so the advice is about the imported file, never `--reset-state`.
    #[error("state import into {path}: {reason}; the state file was not changed. Fix: import a snapshot that `equiroute state export` wrote with this configuration (the same interfaces, providers and policies), or import it with the configuration it came from")]
    Import { path: String, reason: String },
}

/// Why a snapshot could not be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteFailure {
    /// The disk (or the quota) is full.
    NoSpace,
    /// Another I/O error.
    Io,
    /// Not an I/O error (the snapshot could not be encoded, the database refused it).
    Other,
}

impl WriteFailure {
    /// The `/metrics` label value.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            WriteFailure::NoSpace => "no_space",
            WriteFailure::Io => "io_error",
            WriteFailure::Other => "failed",
        }
    }
}

impl StoreError {
    /// Why a write failed ([`WriteFailure::Other`] for an error that is not a write's).
    #[must_use]
    pub fn write_failure(&self) -> WriteFailure {
        match self {
            StoreError::Write { cause, .. } => *cause,
            _ => WriteFailure::Other,
        }
    }
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
    /// `None` after a failed write: redb refuses every write after an I/O error until the
    /// file is opened again, which the next [`Store::save`] does.
    db: Mutex<Option<Database>>,
    file: PathBuf,
    path: String,
    /// The minute the minute rings were last written in: once a minute and at shutdown.
    minutes_saved: AtomicU64,
}

/// What [`Store::open_restoring`] found.
#[derive(Debug, Clone, Copy)]
pub struct Restored {
    /// How long ago the restored snapshot was written (the file's modification time, read
    /// before anything opened it), when the file system tells.
    pub snapshot_age: Option<Duration>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.path)
    }
}

impl Store {
    /// Opens (or creates) the state file, for the gateway and `state import`.
    ///
    /// # Errors
    /// [`StoreError::Locked`] while another open holds the file; [`StoreError::Unusable`] when
    /// it is not a redb database or is damaged (the file is left as it was).
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let shown = path.display().to_string();
        match check(path, &shown) {
            Ok(_) | Err(StoreError::NothingSaved { .. }) => {}
            Err(e) => return Err(e),
        }
        let db = open_file(path, &shown)?;
        Ok(Store {
            db: Mutex::new(Some(db)),
            file: path.to_owned(),
            path: shown,
            minutes_saved: AtomicU64::new(0),
        })
    }

    /// Opens (or creates) the state file for the gateway, after restoring its snapshot into
    /// `state` (built from the current configuration): a file refused (damaged, of another
    /// schema, of other providers or policies) is never opened for writing, so it keeps its
    /// bytes and its modification time. Returns whether there was a snapshot, and its age.
    ///
    /// # Errors
    /// The errors of [`Store::open`], and a snapshot `state` cannot take.
    pub fn open_restoring(
        path: &Path,
        state: &AppState,
    ) -> Result<(Store, Option<Restored>), StoreError> {
        let shown = path.display().to_string();
        // Read first: opening the file for writing may write it.
        let snapshot_age = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok());
        let saved = match check(path, &shown) {
            Ok(saved) => saved,
            Err(StoreError::NothingSaved { .. }) => None,
            Err(e) => return Err(e),
        };
        let restored = match saved {
            Some(bytes) => {
                let unusable = |reason: String| StoreError::Unusable {
                    path: shown.clone(),
                    reason,
                };
                let snap = decode(
                    serde_json::from_slice(&bytes)
                        .map_err(|e| format!("the snapshot cannot be read ({e})")),
                    "it has",
                )
                .map_err(unusable)?;
                apply(&snap, state).map_err(unusable)?;
                Some(Restored { snapshot_age })
            }
            None => None,
        };
        let db = open_file(path, &shown)?;
        let store = Store {
            db: Mutex::new(Some(db)),
            file: path.to_owned(),
            path: shown,
            minutes_saved: AtomicU64::new(0),
        };
        if let Ok(Some(bytes)) = store.with_db(|db| read_key(db, &store.path, MINUTES_KEY)) {
            let _ = crate::server::minutes::restore(state, &bytes);
        }
        Ok((store, restored))
    }

    /// Replaces the snapshot of the state file at `path` with `json` (for `equiroute state
    /// import`), once `json` has passed the check start-up makes with `state` (built from the
    /// gateway's configuration); the file is not opened before, so a refused import leaves it
    /// untouched.
    ///
    /// # Errors
    /// [`StoreError::Import`] when `json` is not a snapshot this configuration loads; the
    /// errors of [`Store::open`] and of the write otherwise.
    pub fn import_file(
        path: &Path,
        json: &serde_json::Value,
        state: &AppState,
    ) -> Result<(), StoreError> {
        let shown = path.display().to_string();
        // A file another process holds is reported as such first, whatever is imported.
        match check(path, &shown) {
            Ok(_) | Err(StoreError::NothingSaved { .. }) => {}
            Err(e) => return Err(e),
        }
        let bytes = imported(json, &shown, state)?;
        Store::open(path)?.write_raw(&bytes)
    }

    /// The last snapshot in the file at `path` as JSON, for `equiroute state export`, without
    /// writing the file or creating it.
    ///
    /// # Errors
    /// [`StoreError::NothingSaved`] when the file does not exist or holds no snapshot; the
    /// errors of [`Store::open`] otherwise.
    pub fn export_file(path: &Path) -> Result<serde_json::Value, StoreError> {
        let shown = path.display().to_string();
        let Some(bytes) = check(path, &shown)? else {
            return Err(StoreError::NothingSaved { path: shown });
        };
        serde_json::from_slice(&bytes).map_err(|e| StoreError::Unusable {
            path: shown,
            reason: format!("the snapshot cannot be read ({e})"),
        })
    }

    /// Deletes the state file (`equiroute serve --reset-state`), unless another open holds it.
    /// Returns whether there was a file.
    ///
    /// # Errors
    /// [`StoreError::Locked`] while another open holds the file; [`StoreError::Io`] when it
    /// cannot be opened or deleted.
    pub fn remove(path: &Path) -> Result<bool, StoreError> {
        let shown = path.display().to_string();
        let io = |e: std::io::Error| StoreError::Io {
            path: shown.clone(),
            reason: e.to_string(),
        };
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io(e)),
        };
        let backend = FileBackend::new(file).map_err(|e| StoreError::Io {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        // Every open of redb holds an exclusive range lock on the file, so a lock over all
        // of it is refused while any is live: the holder's file is not ours to delete.
        match backend.try_lock_range(Bound::Unbounded, Bound::Unbounded) {
            Ok(true) => {}
            Ok(false) => {
                return Err(StoreError::Locked {
                    holder: holder(path),
                    path: shown,
                })
            }
            // Unsure is no: the file may be held.
            Err(e) => {
                return Err(StoreError::Io {
                    path: shown,
                    reason: format!("cannot tell whether another process holds it ({e})"),
                })
            }
        }
        let removed = std::fs::remove_file(path).map_err(io);
        let _ = backend.close();
        removed.map(|()| true)
    }

    fn unusable(&self, reason: impl Into<String>) -> StoreError {
        StoreError::Unusable {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    /// Saves the learning state of `state` in one atomic transaction, opening the file again
    /// first if the previous write failed.
    ///
    /// # Errors
    /// The write or commit failed, or the file cannot be opened again (the previous snapshot
    /// stays intact).
    pub fn save(&self, state: &AppState) -> Result<(), StoreError> {
        let minute = (state.now().0.max(0.0) as u64) / crate::server::ops::MINUTE_MS;
        let due = self.minutes_saved.swap(minute, Ordering::Relaxed) != minute;
        let minutes = due.then(|| crate::server::minutes::saved(state)).flatten();
        let bytes = serde_json::to_vec(&snapshot(state)).map_err(|e| StoreError::Write {
            path: self.path.clone(),
            reason: e.to_string(),
            cause: WriteFailure::Other,
        })?;
        self.write(&bytes, minutes.as_deref())
            .inspect_err(|_| self.minutes_saved.store(u64::MAX, Ordering::Relaxed))
    }

    /// [`Store::save`] at shutdown: the operations view's minute rings are written too.
    /// # Errors
    /// As [`Store::save`].
    pub fn save_final(&self, state: &AppState) -> Result<(), StoreError> {
        self.minutes_saved.store(u64::MAX, Ordering::Relaxed);
        self.save(state)
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

    /// Replaces the snapshot with `json` (for `equiroute state import`), once it has passed
    /// the check start-up makes with `state` (built from the gateway's configuration).
    ///
    /// # Errors
    /// [`StoreError::Import`] when `json` is not a snapshot this configuration loads, or the
    /// write failed.
    pub fn import_json(
        &self,
        json: &serde_json::Value,
        state: &AppState,
    ) -> Result<(), StoreError> {
        let bytes = imported(json, &self.path, state)?;
        self.write_raw(&bytes)
    }

    fn read_raw(&self) -> Result<Option<Vec<u8>>, StoreError> {
        self.with_db(|db| read_key(db, &self.path, KEY))
    }

    /// Runs `f` on the database, opened again first if a failed write dropped it.
    fn with_db<T>(
        &self,
        f: impl FnOnce(&Database) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut db = self.db.lock().map_err(|_| self.unusable("lock poisoned"))?;
        if db.is_none() {
            *db = Some(open_file(&self.file, &self.path).map_err(|e| match e {
                // Most likely the cause of the failed write, still there (the disk is full).
                StoreError::Io { reason, .. } | StoreError::Unusable { reason, .. } => {
                    StoreError::Write {
                        path: self.path.clone(),
                        cause: WriteFailure::Io,
                        reason: format!(
                            "cannot open the file again after a failed write: {reason}"
                        ),
                    }
                }
                e => e,
            })?);
        }
        let Some(open) = db.as_ref() else {
            return Err(self.unusable("not open"));
        };
        let result = guarded(&self.path, || f(open));
        if matches!(result, Err(StoreError::Write { .. })) {
            // redb refuses every write after an I/O error until the file is opened again.
            *db = None;
        }
        result
    }

    fn write_raw(&self, bytes: &[u8]) -> Result<(), StoreError> {
        self.write(bytes, None)
    }

    /// Writes the snapshot `bytes`, and the operations view's `minutes` when given, in one
    /// transaction.
    fn write(&self, bytes: &[u8], minutes: Option<&[u8]>) -> Result<(), StoreError> {
        let write_err = |e: redb::Error| StoreError::Write {
            path: self.path.clone(),
            cause: match &e {
                redb::Error::Io(io) if io.kind() == std::io::ErrorKind::StorageFull => {
                    WriteFailure::NoSpace
                }
                redb::Error::Io(_) | redb::Error::PreviousIo => WriteFailure::Io,
                _ => WriteFailure::Other,
            },
            reason: e.to_string(),
        };
        self.with_db(|db| {
            let txn = db.begin_write().map_err(|e| write_err(e.into()))?;
            {
                let mut table = txn.open_table(SNAPSHOTS).map_err(|e| write_err(e.into()))?;
                table.insert(KEY, bytes).map_err(|e| write_err(e.into()))?;
                if let Some(m) = minutes {
                    table
                        .insert(MINUTES_KEY, m)
                        .map_err(|e| write_err(e.into()))?;
                }
            }
            txn.commit().map_err(|e| write_err(e.into()))
        })
    }
}

/// A parsed snapshot of this build's schema, or why it is unusable (`what` starts the
/// schema message: "it has", "the imported snapshot has").
fn decode(parsed: Result<Snapshot, String>, what: &str) -> Result<Snapshot, String> {
    let snap = parsed?;
    if snap.schema != SCHEMA {
        return Err(format!(
            "{what} schema version {} and this build reads version {SCHEMA}",
            snap.schema
        ));
    }
    Ok(snap)
}

/// The bytes to write for an imported `json`, once it has loaded into `state` as start-up
/// would load it from the file at `path`.
fn imported(json: &serde_json::Value, path: &str, state: &AppState) -> Result<Vec<u8>, StoreError> {
    let refused = |reason: String| StoreError::Import {
        path: path.to_owned(),
        reason,
    };
    let snap = decode(
        serde_json::from_value(json.clone())
            .map_err(|e| format!("the imported file is not an Equiroute state snapshot ({e})")),
        "the imported snapshot has",
    )
    .map_err(refused)?;
    apply(&snap, state).map_err(|e| {
        refused(format!(
            "the imported snapshot is of another configuration, which a gateway would refuse at start ({e})"
        ))
    })?;
    serde_json::to_vec(&snap).map_err(|e| refused(e.to_string()))
}

/// Loads `snap` into `state` (built from the current configuration), or says why this
/// configuration cannot take it.
fn apply(snap: &Snapshot, state: &AppState) -> Result<(), String> {
    let interfaces = state.interfaces();
    for (name, saved) in &snap.interfaces {
        if let Some(iface) = interfaces.get(name) {
            saved.restore(name, iface)?;
        }
    }
    if let Ok(mut pending) = state.pending.lock() {
        for (id, entry) in &snap.pending {
            pending.insert(id, entry);
        }
    }
    Ok(())
}

/// The verified open of the file at `path` (the same as [`check`]'s, now on the file: it may
/// write the recovery of a gateway killed mid-commit, which the check found sound).
fn open_file(path: &Path, shown: &str) -> Result<Database, StoreError> {
    guarded(shown, || {
        Builder::new()
            .set_check_integrity_on_open(true)
            .create(path)
            .map_err(|e| open_error(path, shown, e))
    })
}

/// The first wait before a failed snapshot is tried again; it doubles at each failure, up to
/// the snapshot interval.
const RETRY_FIRST: Duration = Duration::from_secs(1);

/// Saves `state` into `store` every `every`, off the request path (a blocking thread per
/// save), until the task is aborted. A failure is retried with back-off, warned once per
/// outage (and once more when snapshots resume), and counted in `/metrics`
/// (`equiroute_state_snapshots_total`).
pub async fn keep_saving(store: Arc<Store>, state: Arc<AppState>, every: Duration) {
    let mut outage = Outage::default();
    let mut wait = every;
    loop {
        tokio::time::sleep(wait).await;
        let (s, st) = (store.clone(), state.clone());
        let saved = tracing::Instrument::instrument(
            tokio::task::spawn_blocking(move || s.save(&st)),
            tracing::debug_span!("snapshot"),
        )
        .await
        .unwrap_or_else(|e| Err(store.unusable(format!("the snapshot's thread failed ({e})"))));
        wait = outage.record(&state, &saved, every);
    }
}

/// A run of failed snapshots.
#[derive(Debug, Default)]
struct Outage {
    /// When the first failure of the run happened (`None`: snapshots succeed).
    since: Option<std::time::Instant>,
    failures: u64,
    /// The wait after the next failure.
    retry: Duration,
}

impl Outage {
    /// Books one snapshot's result; returns the wait before the next one.
    fn record(
        &mut self,
        state: &AppState,
        saved: &Result<(), StoreError>,
        every: Duration,
    ) -> Duration {
        match saved {
            Ok(()) => {
                state.metrics.snapshot("saved");
                if let Some(since) = self.since.take() {
                    tracing::info!(
                        failed_attempts = self.failures,
                        outage_s = since.elapsed().as_secs(),
                        "snapshots of the learning state resumed"
                    );
                }
                self.failures = 0;
                every
            }
            Err(e) => {
                state.metrics.snapshot(e.write_failure().label());
                self.failures += 1;
                if self.since.is_none() {
                    self.since = Some(std::time::Instant::now());
                    self.retry = RETRY_FIRST;
                    tracing::warn!(
                        error = %e,
                        "snapshot of the learning state failed; the previous one stays. Retrying with back-off; a line says when snapshots resume"
                    );
                } else {
                    tracing::debug!(error = %e, failures = self.failures, "snapshot failed again");
                }
                let wait = self.retry.min(every);
                self.retry = self.retry.saturating_mul(2);
                wait
            }
        }
    }
}

fn snapshot(state: &AppState) -> Snapshot {
    let mut interfaces = BTreeMap::new();
    for (name, iface) in state.interfaces().iter() {
        if let Some(saved) = InterfaceSnapshot::of(state, iface) {
            interfaces.insert(name.clone(), saved);
        }
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

/// The bytes of record `key` (the snapshot's: [`KEY`]) in `db`, if it has one.
fn read_key(
    db: &impl ReadableDatabase,
    path: &str,
    key: &str,
) -> Result<Option<Vec<u8>>, StoreError> {
    let unusable = |e: &dyn std::fmt::Display| StoreError::Unusable {
        path: path.to_owned(),
        reason: format!("cannot be read as an Equiroute state file ({e})"),
    };
    let txn = db.begin_read().map_err(|e| unusable(&e))?;
    let table = match txn.open_table(SNAPSHOTS) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(unusable(&e)),
    };
    let value = table.get(key).map_err(|e| unusable(&e))?;
    Ok(value.map(|v| v.value().to_vec()))
}

/// Checks the file at `path` without writing it: redb opens it with its integrity check on
/// [`Scratch`] storage (the file's locks, a copy of its bytes), and reads the snapshot.
/// Returns the snapshot's bytes; [`StoreError::NothingSaved`] when there is no file.
fn check(path: &Path, shown: &str) -> Result<Option<Vec<u8>>, StoreError> {
    // Read and write: redb's exclusive locks need a file open for writing; nothing is written.
    // A file this user may only read (a read-only mount, a backup's copy) is checked under
    // shared locks instead, which a gateway's open excludes all the same.
    let open = |write: bool| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(path)
    };
    let opened = match open(true) {
        Err(e) if read_only(&e) => open(false).map(|f| (f, true)),
        opened => opened.map(|f| (f, false)),
    };
    let (file, read_only) = match opened {
        Ok(opened) => opened,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(StoreError::NothingSaved {
                path: shown.to_owned(),
            })
        }
        Err(e) => {
            return Err(StoreError::Io {
                path: shown.to_owned(),
                reason: e.to_string(),
            })
        }
    };
    let scratch = Scratch::new(file, read_only).map_err(|e| open_error(path, shown, e))?;
    guarded(shown, || {
        let db = Builder::new()
            .set_check_integrity_on_open(true)
            .create_with_backend(scratch)
            .map_err(|e| open_error(path, shown, e))?;
        read_key(&db, shown, KEY)
    })
}

/// Runs `f`, a call into redb on a file that may be damaged, with a panic turned into
/// [`StoreError::Unusable`]: the last line of defence, behind the integrity check that
/// should keep redb from ever panicking on a file.
fn guarded<T>(path: &str, f: impl FnOnce() -> Result<T, StoreError>) -> Result<T, StoreError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(StoreError::Unusable {
            path: path.to_owned(),
            reason: "cannot be opened as an Equiroute state file (it is damaged: redb failed reading it)"
                .to_owned(),
        })
    })
}

/// The error of an open that redb refused.
fn open_error(path: &Path, shown: &str, e: DatabaseError) -> StoreError {
    match e {
        DatabaseError::DatabaseAlreadyOpen | DatabaseError::LockProtocolMismatch => {
            StoreError::Locked {
                path: shown.to_owned(),
                holder: holder(path),
            }
        }
        // Nothing known to be wrong with the file itself (permissions, a read-only mount, a
        // full disk): no advice to delete it.
        DatabaseError::Storage(redb::StorageError::Io(e))
            if read_only(&e)
                || matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound
                        | std::io::ErrorKind::StorageFull
                        | std::io::ErrorKind::QuotaExceeded
                ) =>
        {
            StoreError::Io {
                path: shown.to_owned(),
                reason: e.to_string(),
            }
        }
        e => StoreError::Unusable {
            path: shown.to_owned(),
            reason: format!("cannot be opened as an Equiroute state file ({e})"),
        },
    }
}

/// Whether `e`, opening a file for writing, means this user may only read it.
fn read_only(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem
    )
}

/// Who holds the lock on `path`, as well as can be told: redb also takes a whole-file
/// `flock`, which `/proc/locks` lists with its owner's pid (its range locks carry none).
fn holder(path: &Path) -> String {
    let pid = lock_owner(path);
    match pid {
        Some(pid) if pid == std::process::id() => format!("this process (pid {pid})"),
        Some(pid) => {
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            match name.trim() {
                "" => format!("another process (pid {pid})"),
                name => format!("another process (pid {pid}, {name})"),
            }
        }
        None => "another process".to_owned(),
    }
}

/// The pid `/proc/locks` gives for a lock on `path`'s inode (Linux only; `None` elsewhere or
/// when no line names one).
#[cfg(target_os = "linux")]
fn lock_owner(path: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    let dev = meta.dev();
    // The kernel prints a device as major:minor in hex, split as glibc's major()/minor() do.
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let file = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    // "1: FLOCK  ADVISORY  WRITE 4869 fe:00:10010800 0 EOF"; range locks show pid -1.
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let at = fields.iter().position(|f| *f == file)?;
        fields
            .get(at.checked_sub(1)?)?
            .parse::<u32>()
            .ok()
            .filter(|p| *p > 0)
    })
}

#[cfg(not(target_os = "linux"))]
fn lock_owner(_path: &Path) -> Option<u32> {
    None
}

/// Storage for checking a state file without writing it: redb's locks are taken on the file
/// itself, so that a file another open holds is refused as such; its bytes are read into
/// memory once those locks are held; and what the open writes (the integrity check commits,
/// a recovery rewrites the header) lands in that copy.
struct Scratch {
    file: FileBackend,
    copy: Mutex<Option<Vec<u8>>>,
    /// The file is open for reading only: its exclusive locks are taken shared (an exclusive
    /// lock needs a file open for writing, and nothing here writes it).
    read_only: bool,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scratch({:?})", self.file)
    }
}

impl Scratch {
    fn new(file: std::fs::File, read_only: bool) -> Result<Scratch, DatabaseError> {
        Ok(Scratch {
            file: FileBackend::new(file)?,
            copy: Mutex::new(None),
            read_only,
        })
    }

    /// Runs `f` on the copy, read from the file on first use (after redb took its locks,
    /// which it does before it reads anything).
    fn with_copy<T>(
        &self,
        f: impl FnOnce(&mut Vec<u8>) -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        let mut copy = self
            .copy
            .lock()
            .map_err(|_| std::io::Error::other("state check: lock poisoned"))?;
        if copy.is_none() {
            let len = usize::try_from(self.file.len()?)
                .map_err(|_| std::io::Error::other("state file larger than memory"))?;
            let mut bytes = vec![0; len];
            self.file.read(0, &mut bytes)?;
            *copy = Some(bytes);
        }
        match copy.as_mut() {
            Some(bytes) => f(bytes),
            None => Err(std::io::Error::other("state check: no copy")),
        }
    }
}

fn past_end() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        "read past the end of the file",
    )
}

impl StorageBackend for Scratch {
    fn len(&self) -> Result<u64, std::io::Error> {
        self.with_copy(|bytes| Ok(bytes.len() as u64))
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        self.with_copy(|bytes| {
            let start = usize::try_from(offset).map_err(|_| past_end())?;
            let end = start.checked_add(out.len()).ok_or_else(past_end)?;
            out.copy_from_slice(bytes.get(start..end).ok_or_else(past_end)?);
            Ok(())
        })
    }

    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        self.with_copy(|bytes| {
            let len = usize::try_from(len).map_err(|_| past_end())?;
            bytes.resize(len, 0);
            Ok(())
        })
    }

    fn sync_data(&self) -> Result<(), std::io::Error> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        self.with_copy(|bytes| {
            let start = usize::try_from(offset).map_err(|_| past_end())?;
            let end = start.checked_add(data.len()).ok_or_else(past_end)?;
            if bytes.len() < end {
                bytes.resize(end, 0);
            }
            bytes[start..end].copy_from_slice(data);
            Ok(())
        })
    }

    fn close(&self) -> Result<(), std::io::Error> {
        self.file.close()
    }

    fn try_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, redb::BackendError> {
        if self.read_only {
            return self.file.try_lock_shared_range(start, end);
        }
        self.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, redb::BackendError> {
        self.file.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), redb::BackendError> {
        if self.read_only {
            return self.file.lock_shared_range(start, end);
        }
        self.file.lock_range(start, end)
    }

    fn lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<(), redb::BackendError> {
        self.file.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), redb::BackendError> {
        self.file.unlock_range(start, end)
    }

    fn query_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, redb::BackendError> {
        self.file.query_lock_range(start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> AppState {
        let text = "[interfaces.search]\nkind = \"tool\"\n[[interfaces.search.providers]]\nid = \"s1\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 1, p95_ms = 2 } }\n";
        let cfg = crate::config::load(text, "t.toml", &|_| None).unwrap_or_else(|e| panic!("{e}"));
        AppState::new(&cfg, 1).unwrap_or_else(|e| panic!("{e}"))
    }

    fn full() -> Result<(), StoreError> {
        Err(StoreError::Write {
            path: "s.redb".into(),
            reason: "No space left on device".into(),
            cause: WriteFailure::NoSpace,
        })
    }

    /// A failed snapshot is retried after 1 s, then 2, 4, ... up to the snapshot interval;
    /// one outage is one run of failures (its start is kept, for one warning), and a success
    /// ends it and goes back to the interval. Every snapshot is counted by outcome.
    #[test]
    fn failed_snapshots_back_off_up_to_the_interval_and_are_counted_by_cause() {
        let st = state();
        let every = Duration::from_secs(5);
        let mut outage = Outage::default();
        let waits: Vec<u64> = (0..5)
            .map(|_| outage.record(&st, &full(), every).as_secs())
            .collect();
        assert_eq!(waits, [1, 2, 4, 5, 5]);
        let since = outage.since;
        assert!(since.is_some() && outage.failures == 5);
        assert_eq!(outage.record(&st, &Ok(()), every), every);
        assert!(outage.since.is_none() && outage.failures == 0);
        // A new outage starts its back-off over.
        assert_eq!(outage.record(&st, &full(), every), Duration::from_secs(1));
        let text = st.metrics.render();
        assert!(
            text.contains("equiroute_state_snapshots_total{outcome=\"no_space\"} 6"),
            "{text}"
        );
        assert!(
            text.contains("equiroute_state_snapshots_total{outcome=\"saved\"} 1"),
            "{text}"
        );
    }
}
