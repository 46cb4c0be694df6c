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

use crate::server::state::{AppState, PendingFeedback};
use equiroute_core::breaker::Breaker;
use equiroute_core::policies::PolicyState;
use redb::backends::FileBackend;
use redb::{Builder, Database, DatabaseError, ReadableDatabase, StorageBackend, TableDefinition};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Bound;
use std::path::Path;
use std::sync::Mutex;

/// Version of the snapshot format.
pub const SCHEMA: u32 = 1;

const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const KEY: &str = "gateway";

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
    /// The file exists but cannot be opened (permissions, I/O): nothing is wrong with its
    /// content as far as anyone knows.
    #[error("state file {path}: cannot open it: {reason}")]
    Io { path: String, reason: String },
    #[error("state file {path}: cannot write the snapshot: {reason}")]
    Write { path: String, reason: String },
}

/// One interface's saved learning state.
#[derive(Debug, Serialize, Deserialize)]
struct InterfaceSnapshot {
    candidates: Vec<String>,
    policy: PolicyState,
    breakers: Vec<Breaker>,
    /// The shadow's and the rollout's state (absent in snapshots written before them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    arms: Option<crate::server::arms::ArmsSnapshot>,
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
        // The same verified open as the check's, now on the file (it may write the recovery
        // of a gateway killed mid-commit, which the check found sound).
        let db = guarded(&shown, || {
            Builder::new()
                .set_check_integrity_on_open(true)
                .create(path)
                .map_err(|e| open_error(path, &shown, e))
        })?;
        Ok(Store { db, path: shown })
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

    /// Saves the learning state of `state` in one atomic transaction.
    ///
    /// # Errors
    /// The write or commit failed (the previous snapshot stays intact).
    pub fn save(&self, state: &AppState) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(&snapshot(state)).map_err(|e| StoreError::Write {
            path: self.path.clone(),
            reason: e.to_string(),
        })?;
        self.write_raw(&bytes)
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
        guarded(&self.path, || read_snapshot(&self.db, &self.path))
    }

    fn write_raw(&self, bytes: &[u8]) -> Result<(), StoreError> {
        let write_err = |e: &dyn std::fmt::Display| StoreError::Write {
            path: self.path.clone(),
            reason: e.to_string(),
        };
        guarded(&self.path, || {
            let txn = self.db.begin_write().map_err(|e| write_err(&e))?;
            {
                let mut table = txn.open_table(SNAPSHOTS).map_err(|e| write_err(&e))?;
                table.insert(KEY, bytes).map_err(|e| write_err(&e))?;
            }
            txn.commit().map_err(|e| write_err(&e))
        })
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
            // A promoted rollout makes the live policy the candidate's first.
            if let Some(arms) = &saved.arms {
                iface
                    .arms
                    .restore(name, arms, &mut policy)
                    .map_err(|e| self.unusable(format!("interface `{name}`: {e}")))?;
            }
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
                arms: iface.arms.export().ok().flatten(),
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

/// The snapshot's bytes in `db`, if it has one.
fn read_snapshot(db: &impl ReadableDatabase, path: &str) -> Result<Option<Vec<u8>>, StoreError> {
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
    let value = table.get(KEY).map_err(|e| unusable(&e))?;
    Ok(value.map(|v| v.value().to_vec()))
}

/// Checks the file at `path` without writing it: redb opens it with its integrity check on
/// [`Scratch`] storage (the file's locks, a copy of its bytes), and reads the snapshot.
/// Returns the snapshot's bytes; [`StoreError::NothingSaved`] when there is no file.
fn check(path: &Path, shown: &str) -> Result<Option<Vec<u8>>, StoreError> {
    // Read and write: redb's exclusive locks need a file open for writing; nothing is written.
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Ok(f) => f,
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
    let scratch = Scratch::new(file).map_err(|e| open_error(path, shown, e))?;
    guarded(shown, || {
        let db = Builder::new()
            .set_check_integrity_on_open(true)
            .create_with_backend(scratch)
            .map_err(|e| open_error(path, shown, e))?;
        read_snapshot(&db, shown)
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
        // Nothing known to be wrong with the file itself: no advice to delete it.
        DatabaseError::Storage(redb::StorageError::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
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
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Scratch({:?})", self.file)
    }
}

impl Scratch {
    fn new(file: std::fs::File) -> Result<Scratch, DatabaseError> {
        Ok(Scratch {
            file: FileBackend::new(file)?,
            copy: Mutex::new(None),
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
