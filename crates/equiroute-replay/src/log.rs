//! Reading audit logs for `equiroute replay`: the files and their rotations, one JSON line at
//! a time (a malformed line is counted and reported, never fatal), then the join of each
//! feedback line to its request by `request_id`, in the order the requests were decided.
//!
//! Lines written before a field existed are read with its fallback: no `kind` is a request;
//! no `decided_ms` is `ts_ms − latency_ms`; no `eligible` is the set `order` ranked; no
//! `deadline_miss` is `outcome = "deadline_exceeded"` or a latency past `deadline_ms`.

use anyhow::bail;
use equiroute_core::{
    AttemptOutcome, AttemptStatus, FeedbackSource, Millis, ProviderFailure, SlicePath,
    TokenEstimate, Usd,
};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Malformed lines described in full; the others are only counted.
const MALFORMED_SHOWN: usize = 10;

/// How a line's feature vector was kept (`[audit] features`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeaturesKept {
    Full,
    Hash,
    None,
}

impl FeaturesKept {
    pub fn as_str(self) -> &'static str {
        match self {
            FeaturesKept::Full => "full",
            FeaturesKept::Hash => "hash",
            FeaturesKept::None => "none",
        }
    }
}

/// An attempt's status as the log writes it.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum StatusName {
    Ok,
    ProviderError,
    ClientError,
    Timeout,
    Cancelled,
}

/// One attempt of a request line.
#[derive(Clone, Debug, Deserialize)]
pub struct AttemptLine {
    pub provider: String,
    status: StatusName,
    #[serde(default)]
    failure: Option<ProviderFailure>,
    #[serde(default)]
    started_ms: Option<f64>,
    pub latency_ms: f64,
    #[serde(default)]
    ttfb_ms: Option<f64>,
    #[serde(default)]
    retry_after_ms: Option<f64>,
    #[serde(default)]
    pub cost_usd: f64,
}

impl AttemptLine {
    /// The outcome as the policy saw it (a provider error of an unknown kind is a 5xx).
    pub fn outcome(&self) -> AttemptOutcome {
        AttemptOutcome {
            latency: Millis(self.latency_ms),
            status: match self.status {
                StatusName::Ok => AttemptStatus::Ok,
                StatusName::ProviderError => {
                    AttemptStatus::ProviderError(self.failure.unwrap_or(ProviderFailure::Server))
                }
                StatusName::ClientError => AttemptStatus::ClientError,
                StatusName::Timeout => AttemptStatus::Timeout,
                StatusName::Cancelled => AttemptStatus::Cancelled,
            },
            cost: Usd(self.cost_usd),
            time_to_first_byte: self.ttfb_ms.map(Millis),
            retry_after: self.retry_after_ms.map(Millis),
        }
    }

    /// When the attempt began; `fallback` (the decision) for logs without it.
    pub fn started(&self, fallback: f64) -> f64 {
        self.started_ms.unwrap_or(fallback)
    }
}

/// One request line (`"kind": "request"`, or no `kind`).
#[derive(Clone, Debug, Deserialize)]
pub struct RequestLine {
    pub ts_ms: f64,
    #[serde(default)]
    decided_ms: Option<f64>,
    pub request_id: String,
    pub interface: String,
    pub policy: String,
    pub candidates: Vec<String>,
    #[serde(default)]
    eligible: Option<Vec<String>>,
    pub order: Vec<String>,
    #[serde(default)]
    pub propensity: Option<f64>,
    #[serde(default)]
    pub propensity_kind: Option<String>,
    #[serde(default)]
    pub features: Option<Vec<f64>>,
    #[serde(default)]
    pub features_hash: Option<String>,
    #[serde(default)]
    pub slice: Option<SlicePath>,
    #[serde(default)]
    pub tokens: Option<TokenEstimate>,
    #[serde(default)]
    pub attempts: Vec<AttemptLine>,
    pub outcome: String,
    pub latency_ms: f64,
    pub cost_usd: f64,
    #[serde(default)]
    pub deadline_ms: Option<f64>,
    #[serde(default)]
    deadline_miss: Option<bool>,
    #[serde(default)]
    failed: Option<bool>,
}

impl RequestLine {
    /// When the request was decided.
    pub fn decided_ms(&self) -> f64 {
        self.decided_ms.unwrap_or(self.ts_ms - self.latency_ms)
    }

    /// The eligible set, by provider id.
    pub fn eligible(&self) -> &[String] {
        self.eligible.as_deref().unwrap_or(&self.order)
    }

    pub fn deadline_miss(&self) -> bool {
        self.deadline_miss.unwrap_or_else(|| {
            self.outcome == "deadline_exceeded"
                || self.deadline_ms.is_some_and(|d| self.latency_ms > d)
        })
    }

    /// No provider answered (every attempt failed, or the deadline passed).
    pub fn failed(&self) -> bool {
        self.failed.unwrap_or(matches!(
            self.outcome.as_str(),
            "failed" | "deadline_exceeded"
        ))
    }

    /// A bad outcome: a failure or a deadline miss.
    pub fn bad(&self) -> bool {
        self.failed() || self.deadline_miss()
    }

    pub fn features_kept(&self) -> FeaturesKept {
        match (&self.features, &self.features_hash) {
            (Some(_), _) => FeaturesKept::Full,
            (None, Some(_)) => FeaturesKept::Hash,
            (None, None) => FeaturesKept::None,
        }
    }

    /// The provider that answered, if one did (the last attempt, when it is `ok`).
    pub fn answered_by(&self) -> Option<&str> {
        self.attempts
            .last()
            .filter(|a| a.status == StatusName::Ok)
            .map(|a| a.provider.as_str())
    }

    /// Values a sound gateway never writes, as (field, why).
    fn check(&self) -> Result<(), (String, String)> {
        if let Some(p) = self.propensity {
            if !(0.0..=1.0).contains(&p) {
                return Err(("propensity".into(), format!("{p} is not a probability")));
            }
        }
        if self.order.is_empty() {
            return Err(("order".into(), "is empty: no candidate was ranked".into()));
        }
        if let Some(bad) = self.order.iter().find(|id| !self.candidates.contains(id)) {
            return Err((
                "order".into(),
                format!("`{bad}` is not one of `candidates`"),
            ));
        }
        Ok(())
    }
}

/// One feedback line (`"kind": "feedback"`).
#[derive(Clone, Debug, Deserialize)]
pub struct FeedbackLine {
    pub ts_ms: f64,
    pub request_id: String,
    pub quality: f64,
    #[serde(default = "api_source")]
    pub source: FeedbackSource,
}

fn api_source() -> FeedbackSource {
    FeedbackSource::Api
}

/// A line of the log.
#[derive(Debug)]
pub enum Line {
    Request(Box<RequestLine>),
    Feedback(FeedbackLine),
}

/// A line that could not be read.
#[derive(Clone, Debug)]
pub struct Malformed {
    pub file: PathBuf,
    pub line: usize,
    pub error: String,
}

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.error)
    }
}

/// Everything read from the files.
#[derive(Debug, Default)]
pub struct LogLines {
    pub requests: Vec<RequestLine>,
    pub feedback: Vec<FeedbackLine>,
    /// The first [`MALFORMED_SHOWN`] malformed lines.
    pub malformed: Vec<Malformed>,
    pub malformed_count: usize,
}

/// Reads one line; `Ok(None)` for a blank one and a `quality_shift` one. The error names the
/// field at fault.
pub fn parse_line(text: &str) -> Result<Option<Line>, String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON ({e})"))?;
    let kind = value.get("kind").map(|k| k.as_str().unwrap_or("?"));
    let field = |e: serde_path_to_error::Error<serde_json::Error>| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            inner.to_string()
        } else {
            format!("`{path}`: {inner}")
        }
    };
    match kind {
        None | Some("request") => {
            let r: RequestLine = serde_path_to_error::deserialize(value).map_err(field)?;
            r.check().map_err(|(f, why)| format!("`{f}`: {why}"))?;
            Ok(Some(Line::Request(Box::new(r))))
        }
        Some("feedback") => {
            let f: FeedbackLine = serde_path_to_error::deserialize(value).map_err(field)?;
            if !(0.0..=1.0).contains(&f.quality) {
                return Err(format!("`quality`: {} is not in [0, 1]", f.quality));
            }
            Ok(Some(Line::Feedback(f)))
        }
        // What the gateway saw, not what it decided: nothing to replay.
        Some("quality_shift") => Ok(None),
        Some(other) => Err(format!(
            "`kind`: `{other}` is none of \"request\", \"feedback\" and \"quality_shift\""
        )),
    }
}

/// The files to read: each one given, then its rotations (`FILE.1`, `FILE.2`, … while they
/// exist), each once.
///
/// # Errors
/// A given file does not exist.
pub fn with_rotations(given: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = Vec::new();
    let push = |p: PathBuf, out: &mut Vec<PathBuf>| {
        let key = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
        if !out
            .iter()
            .any(|q| std::fs::canonicalize(q).unwrap_or_else(|_| q.clone()) == key)
        {
            out.push(p);
        }
    };
    for file in given {
        if !file.is_file() {
            bail!(
                "--audit `{}`: no such file (give the `[audit] path` of the gateway's configuration; its rotations `.1`, `.2`, … are read too)",
                file.display()
            );
        }
        push(file.clone(), &mut out);
        for k in 1.. {
            let mut name = file.clone().into_os_string();
            name.push(format!(".{k}"));
            let rotated = PathBuf::from(name);
            if !rotated.is_file() {
                break;
            }
            push(rotated, &mut out);
        }
    }
    Ok(out)
}

/// Reads every line of `files`.
///
/// # Errors
/// A file cannot be read.
pub fn read(files: &[PathBuf]) -> anyhow::Result<LogLines> {
    let mut out = LogLines::default();
    for file in files {
        let f = std::fs::File::open(file)
            .map_err(|e| anyhow::anyhow!("--audit `{}`: {e}", file.display()))?;
        read_from(file, std::io::BufReader::new(f), &mut out)?;
    }
    Ok(out)
}

fn read_from(file: &Path, reader: impl std::io::BufRead, out: &mut LogLines) -> anyhow::Result<()> {
    for (n, line) in reader.split(b'\n').enumerate() {
        let bytes = line.map_err(|e| anyhow::anyhow!("--audit `{}`: {e}", file.display()))?;
        let parsed = std::str::from_utf8(&bytes)
            .map_err(|_| "not UTF-8".to_owned())
            .and_then(parse_line);
        match parsed {
            Ok(None) => {}
            Ok(Some(Line::Request(r))) => out.requests.push(*r),
            Ok(Some(Line::Feedback(f))) => out.feedback.push(f),
            Err(error) => {
                out.malformed_count += 1;
                if out.malformed.len() < MALFORMED_SHOWN {
                    out.malformed.push(Malformed {
                        file: file.to_path_buf(),
                        line: n + 1,
                        error,
                    });
                }
            }
        }
    }
    Ok(())
}

/// A request with the quality score that arrived for it, if one did.
#[derive(Clone, Debug)]
pub struct Joined {
    pub request: RequestLine,
    pub quality: Option<f64>,
    pub source: Option<FeedbackSource>,
    /// When the score arrived.
    pub feedback_ms: Option<f64>,
}

/// The requests, decided first first, each with its feedback.
#[derive(Debug, Default)]
pub struct JoinedLog {
    pub requests: Vec<Joined>,
    /// Request lines whose id was already read (the first is kept).
    pub duplicate_requests: usize,
    /// Scores for a request no file holds (rotated away, or its record was dropped).
    pub orphan_feedback: usize,
    /// Second scores for one request (the gateway applies only the first).
    pub duplicate_feedback: usize,
}

/// Joins each feedback line to its request by `request_id` and orders the requests by when
/// they were decided.
pub fn join(lines: LogLines) -> JoinedLog {
    let mut out = JoinedLog::default();
    let mut index: HashMap<String, usize> = HashMap::with_capacity(lines.requests.len());
    for request in lines.requests {
        if index.contains_key(&request.request_id) {
            out.duplicate_requests += 1;
            continue;
        }
        index.insert(request.request_id.clone(), out.requests.len());
        out.requests.push(Joined {
            request,
            quality: None,
            source: None,
            feedback_ms: None,
        });
    }
    let mut feedback = lines.feedback;
    feedback.sort_by(|a, b| a.ts_ms.total_cmp(&b.ts_ms));
    for f in feedback {
        match index.get(&f.request_id) {
            None => out.orphan_feedback += 1,
            Some(&i) if out.requests[i].quality.is_some() => out.duplicate_feedback += 1,
            Some(&i) => {
                let j = &mut out.requests[i];
                j.quality = Some(f.quality);
                j.source = Some(f.source);
                j.feedback_ms = Some(f.ts_ms);
            }
        }
    }
    out.requests
        .sort_by(|a, b| a.request.decided_ms().total_cmp(&b.request.decided_ms()));
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn lines(text: &str) -> LogLines {
        let mut out = LogLines::default();
        read_from(Path::new("audit.jsonl"), text.as_bytes(), &mut out).unwrap();
        out
    }

    const NEW: &str = r#"{"kind":"request","ts_ms":1000.0,"decided_ms":900.0,"request_id":"req-1","interface":"chat","policy":"random","candidates":["a","b"],"eligible":["a","b"],"excluded":[],"scores":[],"order":["b","a"],"propensity":0.5,"propensity_kind":"exact","features":[0.5,0.25],"slice":{"keys":[0,1,1,1],"depth":4},"tokens":{"input":10,"output":20},"attempts":[{"provider":"b","status":"provider_error","failure":"rate_limited","started_ms":900.0,"latency_ms":20.0,"retry_after_ms":1000.0,"cost_usd":0.0},{"provider":"a","status":"ok","started_ms":920.0,"latency_ms":80.0,"cost_usd":0.002}],"outcome":"ok","fallback_reason":"provider_error","latency_ms":100.0,"cost_usd":0.002,"deadline_ms":90.0,"deadline_miss":true,"failed":false}"#;

    /// A line as the gateway wrote it before propensity kinds, features and deadlines.
    const OLD: &str = r#"{"ts_ms":500.0,"request_id":"req-0","interface":"chat","policy":"lqm-ts","candidates":["a","b"],"excluded":[],"scores":[],"order":["a","b"],"propensity":null,"attempts":[{"provider":"a","status":"timeout","latency_ms":300.0,"cost_usd":0.0}],"outcome":"deadline_exceeded","fallback_reason":null,"latency_ms":300.0,"cost_usd":0.0}"#;

    #[test]
    fn a_new_line_reads_every_field_the_replay_needs() {
        let Some(Line::Request(r)) = parse_line(NEW).unwrap() else {
            panic!("a request line");
        };
        assert!((r.decided_ms() - 900.0).abs() < 1e-9);
        assert_eq!(r.eligible(), ["a", "b"]);
        assert_eq!(r.features_kept(), FeaturesKept::Full);
        assert!(r.deadline_miss() && !r.failed() && r.bad());
        assert_eq!(r.answered_by(), Some("a"));
        let first = r.attempts[0].outcome();
        assert_eq!(
            first.status,
            AttemptStatus::ProviderError(ProviderFailure::RateLimited)
        );
        assert_eq!(first.retry_after, Some(Millis(1000.0)));
        assert_eq!(
            r.tokens,
            Some(TokenEstimate {
                input: 10,
                output: 20
            })
        );
    }

    #[test]
    fn an_old_line_is_read_with_the_fallbacks_of_the_fields_it_lacks() {
        let Some(Line::Request(r)) = parse_line(OLD).unwrap() else {
            panic!("a line without kind is a request");
        };
        // Decided when it started: it ended at 500 after 300 ms.
        assert!((r.decided_ms() - 200.0).abs() < 1e-9);
        assert_eq!(r.eligible(), ["a", "b"], "the set `order` ranked");
        assert!(r.deadline_miss(), "deadline_exceeded is a miss");
        assert!(r.failed() && r.bad());
        assert_eq!(r.features_kept(), FeaturesKept::None);
        assert_eq!(r.answered_by(), None);
        assert!((r.attempts[0].started(r.decided_ms()) - 200.0).abs() < 1e-9);
    }

    #[test]
    fn malformed_lines_are_counted_with_their_line_and_field_and_the_rest_is_read() {
        let text = format!(
            "{NEW}\n\n{{\"ts_ms\": 1\n{}\n{}\n{}\n{OLD}\n{}\n",
            NEW.replace("\"propensity\":0.5", "\"propensity\":1.5"),
            r#"{"kind":"feedback","ts_ms":1.0,"request_id":"req-1","quality":"high"}"#,
            r#"{"kind":"decision","ts_ms":1.0}"#,
            // Skipped, not malformed: a gateway's own observation, nothing to replay.
            r#"{"kind":"quality_shift","ts_ms":2.0,"interface":"chat","provider":"a","direction":"down","from":0.86,"to":0.41,"scores":6}"#,
        );
        let read = lines(&text);
        assert_eq!(read.requests.len(), 2);
        assert_eq!(read.malformed_count, 4);
        let shown: Vec<String> = read.malformed.iter().map(ToString::to_string).collect();
        assert!(shown[0].starts_with("audit.jsonl:3: not JSON"), "{shown:?}");
        assert!(
            shown[1].starts_with("audit.jsonl:4: `propensity`"),
            "{shown:?}"
        );
        assert!(
            shown[2].starts_with("audit.jsonl:5: `quality`"),
            "{shown:?}"
        );
        assert!(shown[3].contains("`kind`: `decision`"), "{shown:?}");
    }

    #[test]
    fn feedback_joins_its_request_by_id_once_and_requests_come_in_decision_order() {
        let text = [
            NEW,
            OLD,
            r#"{"kind":"feedback","ts_ms":2000.0,"request_id":"req-1","interface":"chat","quality":0.75,"source":"judge"}"#,
            r#"{"kind":"feedback","ts_ms":2500.0,"request_id":"req-1","interface":"chat","quality":0.1,"source":"api"}"#,
            r#"{"kind":"feedback","ts_ms":2600.0,"request_id":"req-9","interface":"chat","quality":0.5,"source":"api"}"#,
            NEW,
        ]
        .join("\n");
        let joined = join(lines(&text));
        let ids: Vec<&str> = joined
            .requests
            .iter()
            .map(|j| j.request.request_id.as_str())
            .collect();
        assert_eq!(ids, ["req-0", "req-1"], "decided at 200, then at 900");
        assert_eq!(joined.requests[0].quality, None);
        assert_eq!(
            joined.requests[1].quality,
            Some(0.75),
            "the first score counts"
        );
        assert_eq!(joined.requests[1].source, Some(FeedbackSource::Judge));
        assert_eq!(joined.requests[1].feedback_ms, Some(2000.0));
        assert_eq!(
            (
                joined.duplicate_requests,
                joined.duplicate_feedback,
                joined.orphan_feedback
            ),
            (1, 1, 1)
        );
    }

    #[test]
    fn rotated_files_are_found_after_the_one_given_and_a_missing_file_is_named() {
        let dir = std::env::temp_dir().join(format!("equiroute-replay-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = dir.join("audit.jsonl");
        for name in [
            "audit.jsonl",
            "audit.jsonl.1",
            "audit.jsonl.2",
            "audit.jsonl.4",
        ] {
            std::fs::write(dir.join(name), "").unwrap();
        }
        let found = with_rotations(&[base.clone(), dir.join("audit.jsonl.1")]).unwrap();
        let names: Vec<String> = found
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]);
        let missing = with_rotations(&[dir.join("nope.jsonl")]).unwrap_err();
        assert!(missing.to_string().contains("nope.jsonl`: no such file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
