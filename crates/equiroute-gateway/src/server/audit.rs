//! The decision audit log: one JSON line per request (candidates, exclusions with reasons,
//! per-candidate scores, the order tried, every attempt's status, latency and cost, the
//! fallback reason, the propensity of the first choice), size-rotated.
//!
//! The request path only `try_send`s a record into a bounded channel; a background task owns
//! the file. When the channel is full the record is dropped and counted, so the log can never
//! slow or fail a request. The task flushes and exits when the gateway's state is dropped.

use serde::Serialize;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::config::AuditConfig;

/// One attempt in a record.
#[derive(Debug, Serialize)]
pub struct AuditAttempt {
    pub provider: String,
    pub status: &'static str,
    /// Why the attempt retried the provider tried just before (`retry_after`,
    /// `server_error`); absent for a first try or a fallback.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry: Option<&'static str>,
    /// The attempt was a hedge (started beside the first while it was still out).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub hedge: bool,
    /// A streamed attempt's time-to-first-byte limit (see `first_byte`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_byte_limit_ms: Option<f64>,
    pub latency_ms: f64,
    pub cost_usd: f64,
}

/// One request's decision and execution.
#[derive(Debug, Serialize)]
pub struct AuditRecord {
    pub ts_ms: f64,
    pub request_id: String,
    pub interface: String,
    pub policy: &'static str,
    pub candidates: Vec<String>,
    pub excluded: Vec<(String, String)>,
    pub scores: Vec<serde_json::Value>,
    pub order: Vec<String>,
    pub propensity: Option<f64>,
    /// Every usable provider's breaker was open; the first was probed as a last resort.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub last_resort: bool,
    pub attempts: Vec<AuditAttempt>,
    pub outcome: String,
    pub fallback_reason: Option<String>,
    pub latency_ms: f64,
    pub cost_usd: f64,
}

/// The sending side, held by the gateway's state.
#[derive(Debug)]
pub struct AuditLog {
    tx: tokio::sync::mpsc::Sender<AuditRecord>,
    dropped: AtomicU64,
}

impl AuditLog {
    /// Starts the writer task; returns the log and the task to await after shutdown.
    ///
    /// # Errors
    /// The file cannot be opened for appending.
    pub fn start(cfg: AuditConfig) -> std::io::Result<(AuditLog, tokio::task::JoinHandle<()>)> {
        let file = open(&cfg.path)?;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<AuditRecord>(4096);
        let handle = tokio::task::spawn_blocking(move || {
            let mut size = file.metadata().map_or(0, |m| m.len());
            let mut out = std::io::BufWriter::new(file);
            while let Some(record) = rx.blocking_recv() {
                let Ok(mut line) = serde_json::to_vec(&record) else {
                    continue;
                };
                line.push(b'\n');
                if size + line.len() as u64 > cfg.max_bytes && size > 0 {
                    let _ = out.flush();
                    if let Some(file) = rotate(&cfg) {
                        out = std::io::BufWriter::new(file);
                        size = 0;
                    }
                }
                if out.write_all(&line).is_ok() {
                    size += line.len() as u64;
                }
                if rx.is_empty() {
                    let _ = out.flush();
                }
            }
            let _ = out.flush();
        });
        Ok((
            AuditLog {
                tx,
                dropped: AtomicU64::new(0),
            },
            handle,
        ))
    }

    /// Queues a record without waiting; counts it as dropped if the queue is full.
    pub fn record(&self, record: AuditRecord) {
        if self.tx.try_send(record).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records dropped because the writer fell behind.
    #[must_use]
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

fn open(path: &PathBuf) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

/// `path.(k-1)` → `path.k` for k = keep…2, `path` → `path.1`, then a fresh `path`.
fn rotate(cfg: &AuditConfig) -> Option<std::fs::File> {
    let name = |k: u32| {
        let mut p = cfg.path.clone().into_os_string();
        p.push(format!(".{k}"));
        PathBuf::from(p)
    };
    if cfg.keep == 0 {
        let _ = std::fs::remove_file(&cfg.path);
    } else {
        for k in (1..cfg.keep).rev() {
            let _ = std::fs::rename(name(k), name(k + 1));
        }
        let _ = std::fs::rename(&cfg.path, name(1));
    }
    open(&cfg.path).ok()
}
