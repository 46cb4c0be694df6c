//! The decision audit log: one JSON line per request (candidates, the eligible set, exclusions
//! with reasons, per-candidate scores, the order tried, the propensity of the first choice and
//! how it is known, the request's features or their digest, every attempt's status, latency
//! and cost, the deadline and whether it was missed, the fallback reason), and one small line
//! per quality score accepted later (`"kind": "feedback"`), joined to its request by
//! `request_id` (see `equiroute replay`), and one per quality shift the live policy detected
//! (`"kind": "quality_shift"`, see [`super::shifts`]; `equiroute replay` skips them).
//! Size-rotated.
//!
//! The request path only `try_send`s a record into a bounded channel; a background task owns
//! the file. When the channel is full the record is dropped and counted, so the log can never
//! slow or fail a request. The task flushes and exits when the gateway's state is dropped.
//!
//! Compatibility: fields are only ever added. A reader treats a line without `kind` as a
//! request record and every field added since the first version as optional.

use equiroute_core::{FeedbackSource, ProviderFailure, SlicePath, TokenEstimate};
use serde::Serialize;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::config::{AuditConfig, AuditFeatures};

/// One attempt in a record.
#[derive(Debug, Default, Serialize)]
pub struct AuditAttempt {
    pub provider: String,
    pub status: &'static str,
    /// Which provider failure, for `provider_error` (`rate_limited`, `server`, `connection`,
    /// `stream_broken`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<ProviderFailure>,
    /// Why the attempt retried the provider tried just before (`retry_after`,
    /// `server_error`); absent for a first try or a fallback.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry: Option<&'static str>,
    /// The attempt was a hedge (started beside the first while it was still out).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub hedge: bool,
    /// The attempt continued a stream that broke after it reached the client
    /// (`stream_resume`): `prefix` (the partial answer sent as an assistant prefill) or
    /// `restart` (the answer sent again whole, after a marker event).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continuation: Option<&'static str>,
    /// A streamed attempt's time-to-first-byte limit (see `first_byte`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_byte_limit_ms: Option<f64>,
    /// When the attempt began (Unix ms).
    pub started_ms: f64,
    pub latency_ms: f64,
    /// A streamed attempt's time to its first byte.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttfb_ms: Option<f64>,
    /// The provider's `Retry-After`, when it sent one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<f64>,
    pub cost_usd: f64,
    /// The request members the provider's API could not express and dropped
    /// (`unsupported_params = "drop"`): fixed names (`user`, `messages[].name`, ...), never
    /// values; absent when none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub dropped_params: Vec<&'static str>,
}

/// One request's decision and execution.
#[derive(Debug, Default, Serialize)]
pub struct AuditRecord {
    /// `"request"` (a line without `kind` is one too: logs written before it existed).
    pub kind: &'static str,
    /// When the request ended (Unix ms).
    pub ts_ms: f64,
    /// When it was decided: eligibility and ranking (Unix ms).
    pub decided_ms: f64,
    pub request_id: String,
    pub interface: String,
    pub policy: &'static str,
    /// The interface's candidates: their positions are the index space of the policy (and of
    /// `equiroute replay`).
    pub candidates: Vec<String>,
    /// The candidates that passed eligibility, in configuration order.
    pub eligible: Vec<String>,
    pub excluded: Vec<(String, String)>,
    pub scores: Vec<serde_json::Value>,
    pub order: Vec<String>,
    /// The probability with which the policy put `order[0]` first.
    pub propensity: Option<f64>,
    /// How that probability is known: `exact`, `estimated` (from `propensity_draws` rankings)
    /// or `deterministic` (1 by construction: the log supports only policies that agree).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub propensity_kind: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub propensity_draws: Option<u32>,
    /// The request's feature vector (`[audit] features = "full"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub features: Option<Vec<f64>>,
    /// A stable digest of the feature vector (`features = "hash"`, the default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub features_hash: Option<String>,
    /// The request's statistics slice and token estimate, as the policy ranked with them.
    pub slice: SlicePath,
    pub tokens: TokenEstimate,
    /// Every usable provider's breaker was open; the first was probed as a last resort.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub last_resort: bool,
    /// The first attempt was a re-test its breaker asked for (a provider that failed, tried
    /// again ahead of the policy's choice); `propensity` is then absent.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub retest: bool,
    pub attempts: Vec<AuditAttempt>,
    pub outcome: String,
    pub fallback_reason: Option<String>,
    pub latency_ms: f64,
    pub cost_usd: f64,
    /// The request's deadline, if it had one.
    pub deadline_ms: Option<f64>,
    /// The request ended past its deadline, or was cut off by it.
    pub deadline_miss: bool,
    /// No provider answered: every attempt failed, or the deadline passed.
    pub failed: bool,
}

/// A quality score accepted for an earlier request (`"kind": "feedback"`).
#[derive(Debug, Serialize)]
pub struct FeedbackRecord {
    pub kind: &'static str,
    pub ts_ms: f64,
    pub request_id: String,
    pub interface: String,
    pub quality: f64,
    /// The source the poster declared (`api` when it declared none).
    pub source: FeedbackSource,
    /// Who posted it: `api` (`POST /v1/feedback`) or `gateway_judge` (the interface's judge).
    pub scored_by: &'static str,
    /// The label of the key that posted it (never the key); absent for the gateway's judge and
    /// on a gateway without keys.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

impl FeedbackRecord {
    #[must_use]
    pub fn new(
        ts_ms: f64,
        request_id: &str,
        interface: &str,
        quality: f64,
        source: FeedbackSource,
        caller: &super::auth::Caller,
    ) -> FeedbackRecord {
        FeedbackRecord {
            kind: "feedback",
            ts_ms,
            request_id: request_id.to_owned(),
            interface: interface.to_owned(),
            quality,
            source,
            scored_by: match caller {
                super::auth::Caller::Internal => "gateway_judge",
                super::auth::Caller::Key(..) | super::auth::Caller::Anonymous => "api",
            },
            key: caller.label().map(str::to_owned),
        }
    }
}

/// A line of the log.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Line {
    Request(Box<AuditRecord>),
    Feedback(FeedbackRecord),
    QualityShift(super::shifts::ShiftRecord),
}

/// The digest of a feature vector written with `features = "hash"`: FNV-1a over each value's
/// IEEE-754 bits (little-endian), 16 hex digits. Stable across runs, builds and machines.
#[must_use]
pub fn features_hash(features: &[f64]) -> String {
    let mut h = equiroute_core::features::Fnv64::new();
    for x in features {
        h.write(&x.to_bits().to_le_bytes());
    }
    format!("{:016x}", h.finish())
}

/// The sending side, held by the gateway's state.
#[derive(Debug)]
pub struct AuditLog {
    tx: tokio::sync::mpsc::Sender<Line>,
    dropped: AtomicU64,
    features: AuditFeatures,
}

impl AuditLog {
    /// Starts the writer task; returns the log and the task to await after shutdown.
    ///
    /// # Errors
    /// The file cannot be opened for appending.
    pub fn start(cfg: AuditConfig) -> std::io::Result<(AuditLog, tokio::task::JoinHandle<()>)> {
        let file = open(&cfg.path)?;
        let features = cfg.features;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Line>(4096);
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
                features,
            },
            handle,
        ))
    }

    /// Queues a record without waiting; counts it as dropped if the queue is full.
    pub fn record(&self, record: AuditRecord) {
        self.send(Line::Request(Box::new(record)));
    }

    /// Queues a feedback record, as [`AuditLog::record`].
    pub fn feedback(&self, record: FeedbackRecord) {
        self.send(Line::Feedback(record));
    }

    /// Queues a quality shift's record, as [`AuditLog::record`].
    pub fn quality_shift(&self, record: super::shifts::ShiftRecord) {
        self.send(Line::QualityShift(record));
    }

    fn send(&self, line: Line) {
        if self.tx.try_send(line).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How request records keep their features.
    #[must_use]
    pub fn features(&self) -> AuditFeatures {
        self.features
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

#[cfg(test)]
mod tests {
    use super::features_hash;

    #[test]
    fn the_features_digest_is_fnv_over_the_bits_fixed_forever() {
        // Computed independently (FNV-1a 64 over the little-endian IEEE-754 bits, then the
        // avalanche of `Fnv64::finish`): a changed digest breaks every log written before.
        assert_eq!(features_hash(&[0.5, -1.0]), "2d5a1ce99c46f72f");
        assert_eq!(features_hash(&[]), "f52a15e9a9b5e89b");
        // A trailing zero is another vector.
        assert_eq!(features_hash(&[0.5, -1.0, 0.0]), "4b6045b38dfcddce");
    }

    #[test]
    fn request_and_feedback_lines_carry_their_kind() {
        let request = super::AuditRecord {
            kind: "request",
            ..super::AuditRecord::default()
        };
        let line =
            serde_json::to_value(super::Line::Request(Box::new(request))).unwrap_or_default();
        assert_eq!(line["kind"], "request");
        assert!(line.get("features").is_none() && line.get("features_hash").is_none());
        let fb = super::FeedbackRecord::new(
            5.0,
            "req-1",
            "chat",
            0.75,
            equiroute_core::FeedbackSource::Judge,
            &super::super::auth::Caller::Internal,
        );
        let line = serde_json::to_value(super::Line::Feedback(fb)).unwrap_or_default();
        assert_eq!(
            line,
            serde_json::json!({"kind": "feedback", "ts_ms": 5.0, "request_id": "req-1", "interface": "chat", "quality": 0.75, "source": "judge", "scored_by": "gateway_judge"})
        );
        let grant = crate::config::KeyGrant {
            label: "TEAM_A_KEY".into(),
            role: crate::config::KeyRole::Client,
            tenant: None,
            task_classes: None,
        };
        let fb = super::FeedbackRecord::new(
            6.0,
            "req-2",
            "chat",
            0.5,
            equiroute_core::FeedbackSource::User,
            &super::super::auth::Caller::Key(0, std::sync::Arc::new(grant)),
        );
        let line = serde_json::to_value(super::Line::Feedback(fb)).unwrap_or_default();
        assert_eq!(
            (&line["scored_by"], &line["key"], &line["source"]),
            (&"api".into(), &"TEAM_A_KEY".into(), &"user".into())
        );
    }
}
