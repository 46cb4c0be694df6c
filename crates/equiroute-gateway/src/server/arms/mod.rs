//! The policies beside an interface's live one (see docs/rollout.md):
//!
//! - a **shadow** ranks every live request's eligible set from its own state and learns
//!   from every observation the live policy learns from, but never acts: it only counts how
//!   often its first choice agrees with the live policy's and keeps a bounded window of
//!   recent decisions for an off-policy estimate;
//! - a **rollout** (canary) routes a share of the requests, chosen by a stable hash of the
//!   `x-equiroute-session-id` header (else of the request's own number), with a candidate
//!   policy that has its own state and learns from its own traffic only; an anytime-valid
//!   guard ([`equiroute_core::sequential`]) rolls it back automatically when its bad-outcome
//!   rate or quality is worse than the live arm's beyond a margin. Promotion is by an operator.
//!
//! Like the live policy, a side policy ranks on the read side of its lock and learns on the
//! write side only when it is free; otherwise the observation waits in a bounded queue,
//! applied by the next writer. Nothing here is held across an `.await`.

use super::error::Poisoned;
use crate::config::{GuardConfig, RolloutConfig};
use crate::shared::{RolloutEnd, RolloutOutcome};
use equiroute_core::executor::RequestStatus;
use equiroute_core::policies::{
    AttemptObservation, Observation, Policy, PolicyConfig, PolicyKind, QualityObservation,
    RankContext, Ranking,
};
use equiroute_core::sequential::{mixing_precision, BoundedMean, Comparison, Guard, Interval};
use rand::SeedableRng;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, RwLock, RwLockWriteGuard};

mod report;
mod snapshot;

pub use report::render_metrics;
pub use snapshot::{ArmsSnapshot, Restored, RolloutSnapshot};

/// The request header whose value keeps one conversation on one arm of a rollout.
pub const SESSION_HEADER: &str = "x-equiroute-session-id";

/// Observations a side policy queues while its lock is busy; beyond, they are dropped and
/// counted (a side policy must never slow the live path down).
const MAX_DEFERRED: usize = 4096;

/// Recent live decisions the shadow keeps for its off-policy estimate.
pub const SHADOW_WINDOW: usize = 1024;

/// Candidate-arm request ids remembered so that their quality feedback reaches the candidate.
const MAX_CANDIDATE_REQUESTS: usize = 16_384;

/// Which policy routed a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Arm {
    #[default]
    Live,
    Candidate,
}

impl Arm {
    /// The metric label.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Arm::Live => "live",
            Arm::Candidate => "candidate",
        }
    }
}

/// Which arm routed request number `n`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Routed {
    pub arm: Arm,
    pub n: u64,
    /// The name of the policy that ranked it (for the audit log).
    pub policy: &'static str,
}

/// A policy with its own state beside the live one.
#[derive(Debug)]
pub struct SidePolicy {
    pub kind: PolicyKind,
    policy: RwLock<Box<dyn Policy>>,
    deferred: Mutex<VecDeque<Observation>>,
    deferred_len: AtomicUsize,
    /// Observations learnt.
    pub learnt: AtomicU64,
    /// Observations dropped because the queue was full.
    pub dropped: AtomicU64,
}

impl SidePolicy {
    fn new(
        config: &PolicyConfig,
        iface: &crate::config::InterfaceConfig,
    ) -> Result<SidePolicy, equiroute_core::ConfigError> {
        let candidates: Vec<_> = iface
            .providers
            .iter()
            .map(|p| p.candidate.clone())
            .collect();
        Ok(SidePolicy {
            kind: config.kind(),
            policy: RwLock::new(config.build(&candidates, iface.feature_dim)?),
            deferred: Mutex::new(VecDeque::new()),
            deferred_len: AtomicUsize::new(0),
            learnt: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        })
    }

    fn rank(
        &self,
        ctx: &RankContext<'_>,
        rng: &mut dyn rand::RngCore,
    ) -> Result<Ranking, Poisoned> {
        let policy = self.policy.read().map_err(|_| Poisoned)?;
        Ok(policy.rank(ctx, rng))
    }

    /// Learns `obs` now if the write side is free, else queues it (bounded).
    pub(crate) fn observe(&self, obs: impl FnOnce() -> Observation) {
        match self.policy.try_write() {
            Ok(mut policy) => {
                self.drain(policy.as_mut());
                obs().apply(policy.as_mut());
                self.learnt.fetch_add(1, Ordering::Relaxed);
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                let Ok(mut queue) = self.deferred.lock() else {
                    return;
                };
                if queue.len() < MAX_DEFERRED {
                    queue.push_back(obs());
                    self.deferred_len.store(queue.len(), Ordering::Release);
                } else {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(std::sync::TryLockError::Poisoned(_)) => {}
        }
    }

    fn drain(&self, policy: &mut dyn Policy) {
        if self.deferred_len.load(Ordering::Acquire) == 0 {
            return;
        }
        let batch = match self.deferred.lock() {
            Ok(mut queue) => {
                self.deferred_len.store(0, Ordering::Release);
                std::mem::take(&mut *queue)
            }
            Err(_) => return,
        };
        for obs in batch {
            obs.apply(policy);
            self.learnt.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The write side, with the queued observations applied first.
    ///
    /// # Errors
    /// A poisoned lock.
    pub fn write(&self) -> Result<RwLockWriteGuard<'_, Box<dyn Policy>>, Poisoned> {
        let mut policy = self.policy.write().map_err(|_| Poisoned)?;
        self.drain(policy.as_mut());
        Ok(policy)
    }
}

/// One live decision as the shadow saw it.
#[derive(Clone, Debug)]
struct ShadowRecord {
    n: u64,
    request_id: Option<String>,
    features: Vec<f64>,
    eligible: Vec<usize>,
    /// The live policy's first choice and its probability, when the policy defines one.
    live_first: usize,
    live_propensity: Option<f64>,
    shadow_first: usize,
    /// The request ended failed or past its deadline (`None`: not finished, or the client's
    /// own error).
    bad: Option<bool>,
    quality: Option<f64>,
}

/// A shadow policy and what it has seen.
#[derive(Debug)]
pub struct Shadow {
    pub policy: SidePolicy,
    /// Live decisions the shadow ranked, and those whose first choice it shared.
    pub decisions: AtomicU64,
    pub agreements: AtomicU64,
    window: Mutex<VecDeque<ShadowRecord>>,
}

/// The state of a rollout.
#[derive(Clone, Debug, PartialEq)]
pub enum RolloutStatus {
    Running,
    /// Rolled back by the guard on `metric` (`bad_rate` or `quality`).
    RolledBack {
        metric: &'static str,
        evidence: Comparison,
        at_unix_ms: f64,
    },
    Promoted {
        at_unix_ms: f64,
    },
    Aborted {
        at_unix_ms: f64,
    },
}

impl RolloutStatus {
    /// The status an end shared by another instance sets.
    fn of_shared(end: &RolloutEnd) -> RolloutStatus {
        let at_unix_ms = end.at_unix_ms;
        match end.outcome {
            RolloutOutcome::Promoted => RolloutStatus::Promoted { at_unix_ms },
            RolloutOutcome::Aborted => RolloutStatus::Aborted { at_unix_ms },
            RolloutOutcome::RolledBack => RolloutStatus::RolledBack {
                metric: if end.metric.as_deref() == Some("quality") {
                    "quality"
                } else {
                    "bad_rate"
                },
                evidence: end.evidence.unwrap_or(Comparison {
                    candidate: BoundedMean::default(),
                    live: BoundedMean::default(),
                    difference: Interval {
                        low: f64::NAN,
                        high: f64::NAN,
                    },
                    worse: true,
                }),
                at_unix_ms,
            },
        }
    }

    /// What other instances are told of this end (`None` while running).
    fn shared(&self, policy: &str) -> Option<RolloutEnd> {
        let (outcome, metric, at_unix_ms, evidence) = match self {
            RolloutStatus::Running => return None,
            RolloutStatus::RolledBack {
                metric,
                evidence,
                at_unix_ms,
            } => (
                RolloutOutcome::RolledBack,
                Some((*metric).to_owned()),
                *at_unix_ms,
                Some(*evidence),
            ),
            RolloutStatus::Promoted { at_unix_ms } => {
                (RolloutOutcome::Promoted, None, *at_unix_ms, None)
            }
            RolloutStatus::Aborted { at_unix_ms } => {
                (RolloutOutcome::Aborted, None, *at_unix_ms, None)
            }
        };
        Some(RolloutEnd {
            policy: policy.to_owned(),
            outcome,
            metric,
            at_unix_ms,
            evidence,
            instance: String::new(),
        })
    }

    /// Index into [`EVENTS`] (`None` while running).
    fn event(&self) -> Option<usize> {
        match self {
            RolloutStatus::Running => None,
            RolloutStatus::RolledBack { metric, .. } => Some(usize::from(*metric == "quality")),
            RolloutStatus::Promoted { .. } => Some(2),
            RolloutStatus::Aborted { .. } => Some(3),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            RolloutStatus::Running => "running",
            RolloutStatus::RolledBack { .. } => "rolled_back",
            RolloutStatus::Promoted { .. } => "promoted",
            RolloutStatus::Aborted { .. } => "aborted",
        }
    }
}

/// What a rollout has measured, per arm (index 0 live, 1 candidate).
#[derive(Debug)]
struct RolloutStats {
    status: RolloutStatus,
    /// 1 for a failed request or one past its deadline, 0 for an answered one.
    bad: [BoundedMean; 2],
    /// Quality scores (stored as `1 − quality`, so that lower is better, as for `bad`).
    unquality: [BoundedMean; 2],
    candidate_requests: VecDeque<String>,
    /// The end was decided on another instance and shared through Redis.
    ended_elsewhere: bool,
}

/// A canary rollout of a candidate policy.
#[derive(Debug)]
pub struct Rollout {
    pub policy: SidePolicy,
    pub config: RolloutConfig,
    /// Routing new requests to the candidate (false once rolled back, promoted or aborted).
    active: AtomicBool,
    stats: Mutex<RolloutStats>,
    /// Events by kind: rolled back on the bad rate, on quality, promoted, aborted.
    events: [AtomicU64; 4],
    /// The same, decided on another instance and applied here (state shared through Redis).
    received: [AtomicU64; 4],
}

const EVENTS: [&str; 4] = ["rollback_bad_rate", "rollback_quality", "promote", "abort"];

/// An interface's side policies, and the name of its live policy (which a promotion changes).
#[derive(Debug)]
pub struct Arms {
    /// Index into [`PolicyKind::ALL`] of the live policy.
    live_kind: AtomicUsize,
    /// The same, as configured (before any promotion).
    configured_kind: usize,
    pub shadow: Option<Shadow>,
    pub rollout: Option<Rollout>,
}

impl Arms {
    /// The side policies `cfg` configures.
    ///
    /// # Errors
    /// A policy that cannot be built (already checked by config loading).
    pub fn new(cfg: &crate::config::InterfaceConfig) -> Result<Arms, equiroute_core::ConfigError> {
        Ok(Arms {
            live_kind: AtomicUsize::new(kind_index(cfg.policy.kind())),
            configured_kind: kind_index(cfg.policy.kind()),
            shadow: match &cfg.shadow {
                None => None,
                Some(p) => Some(Shadow {
                    policy: SidePolicy::new(p, cfg)?,
                    decisions: AtomicU64::new(0),
                    agreements: AtomicU64::new(0),
                    window: Mutex::new(VecDeque::with_capacity(SHADOW_WINDOW)),
                }),
            },
            rollout: match &cfg.rollout {
                None => None,
                Some(r) => Some(Rollout {
                    policy: SidePolicy::new(&r.policy, cfg)?,
                    config: r.clone(),
                    active: AtomicBool::new(true),
                    stats: Mutex::new(RolloutStats {
                        status: RolloutStatus::Running,
                        bad: [BoundedMean::default(); 2],
                        unquality: [BoundedMean::default(); 2],
                        candidate_requests: VecDeque::new(),
                        ended_elsewhere: false,
                    }),
                    events: Default::default(),
                    received: Default::default(),
                }),
            },
        })
    }

    /// The live policy's name.
    #[must_use]
    pub fn live_name(&self) -> &'static str {
        PolicyKind::ALL
            .get(self.live_kind.load(Ordering::Relaxed))
            .map_or("unknown", |k| k.as_str())
    }

    /// Makes `kind` the live policy's name (a promotion).
    pub fn set_live(&self, kind: PolicyKind) {
        self.live_kind.store(kind_index(kind), Ordering::Relaxed);
    }

    /// Applies a rollout's end shared through Redis, the first in the stream's order (`own`:
    /// decided here, already in effect). An end decided elsewhere stops the canary here too
    /// and is counted as received; a promotion makes the candidate's name the live one (its
    /// policy arrives with the sync's rebuild). When this instance meanwhile ended the
    /// rollout otherwise (say promoted while another's guard rolled it back), the stream's
    /// first end wins on every instance.
    pub fn apply_shared_end(&self, iface: &str, end: &RolloutEnd, own: bool) {
        let Some(r) = &self.rollout else { return };
        if own || end.policy != r.policy.kind.as_str() {
            return;
        }
        let Ok(mut stats) = r.stats.lock() else {
            return;
        };
        let status = RolloutStatus::of_shared(end);
        if stats.status.name() == status.name() {
            // Both decided the same (each on its own evidence): this one's stays.
            return;
        }
        if stats.status != RolloutStatus::Running {
            tracing::warn!(
                interface = iface,
                candidate = end.policy,
                here = stats.status.name(),
                first = status.name(),
                "this instance ended the canary after another instance had ended it otherwise: the first end in the shared stream holds on every instance"
            );
        }
        let was_promoted = matches!(stats.status, RolloutStatus::Promoted { .. });
        r.active.store(false, Ordering::Relaxed);
        if let Some(i) = status.event() {
            r.received[i].fetch_add(1, Ordering::Relaxed);
        }
        tracing::warn!(
            interface = iface,
            candidate = end.policy,
            state = status.name(),
            metric = end.metric.as_deref().unwrap_or(""),
            instance = end.instance,
            "canary ended by another instance: every request goes to the live policy again"
        );
        if matches!(status, RolloutStatus::Promoted { .. }) {
            self.set_live(r.policy.kind);
        } else if was_promoted {
            if let Some(kind) = PolicyKind::ALL.get(self.configured_kind) {
                self.set_live(*kind);
            }
        }
        stats.status = status;
        stats.ended_elsewhere = true;
    }

    /// The arm of a request whose session key is `session` (else the request's `seed`).
    fn assign(&self, session: Option<&str>, seed: u64) -> Arm {
        let Some(r) = self
            .rollout
            .as_ref()
            .filter(|r| r.active.load(Ordering::Relaxed))
        else {
            return Arm::Live;
        };
        let h = session.map_or(seed, |s| fnv1a(s.as_bytes()));
        // A point in [0, 100) from the hash's top 53 bits.
        let point = (h >> 11) as f64 / (1u64 << 53) as f64 * 100.0;
        if point < r.config.percent {
            Arm::Candidate
        } else {
            Arm::Live
        }
    }
}

fn kind_index(kind: PolicyKind) -> usize {
    PolicyKind::ALL.iter().position(|k| *k == kind).unwrap_or(0)
}

/// FNV-1a, 64 bits: stable across processes and versions, so a session stays on its arm
/// across restarts and instances.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// What the side policies need of an interface: its name, candidates, live policy and arms.
/// The gateway's `InterfaceRuntime` is one (this module names nothing above it).
pub trait Interface {
    /// The interface's name.
    fn name(&self) -> &str;
    /// Its candidates, in configuration order.
    fn candidates(&self) -> &[equiroute_core::Candidate];
    /// Its live policy.
    fn live_policy(&self) -> &RwLock<Box<dyn Policy>>;
    /// Its shadow and rollout.
    fn arms(&self) -> &Arms;
}

impl<T: Interface> Interface for std::sync::Arc<T> {
    fn name(&self) -> &str {
        T::name(self)
    }
    fn candidates(&self) -> &[equiroute_core::Candidate] {
        T::candidates(self)
    }
    fn live_policy(&self) -> &RwLock<Box<dyn Policy>> {
        T::live_policy(self)
    }
    fn arms(&self) -> &Arms {
        T::arms(self)
    }
}

/// Books the end of a request with the arms of `iface` ([`Arms::finish`]).
pub fn finish(
    iface: &impl Interface,
    request_id: &str,
    routed: Routed,
    status: RequestStatus,
    now_unix_ms: f64,
) -> Option<RolloutEnd> {
    iface
        .arms()
        .finish(iface.name(), request_id, routed, status, now_unix_ms)
}

/// Ranks request number `n` with the arm it belongs to, and lets the shadow rank it too.
///
/// # Errors
/// A poisoned lock.
pub fn rank(
    iface: &impl Interface,
    ctx: &RankContext<'_>,
    session: Option<&str>,
    seed: u64,
    n: u64,
) -> Result<(Ranking, Routed), Poisoned> {
    let arms = iface.arms();
    let arm = arms.assign(session, seed);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (ranking, policy) = if let (Arm::Candidate, Some(r)) = (arm, &arms.rollout) {
        (r.policy.rank(ctx, &mut rng)?, r.policy.kind.as_str())
    } else {
        let policy = iface.live_policy().read().map_err(|_| Poisoned)?;
        (policy.rank(ctx, &mut rng), arms.live_name())
    };
    if let (Arm::Live, Some(shadow), Some(first)) = (arm, &arms.shadow, ranking.order.first()) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5ade_5ade_5ade_5ade);
        let theirs = shadow.policy.rank(ctx, &mut rng)?;
        if let Some(mine) = theirs.order.first() {
            shadow.decisions.fetch_add(1, Ordering::Relaxed);
            if mine.index == first.index {
                shadow.agreements.fetch_add(1, Ordering::Relaxed);
            }
            let mut window = shadow.window.lock().map_err(|_| Poisoned)?;
            if window.len() == SHADOW_WINDOW {
                window.pop_front();
            }
            window.push_back(ShadowRecord {
                n,
                request_id: None,
                features: ctx.features.to_vec(),
                eligible: ctx.eligible.to_vec(),
                live_first: first.index,
                live_propensity: ranking.first_choice_probability(),
                shadow_first: mine.index,
                bad: None,
                quality: None,
            });
        }
    }
    Ok((ranking, Routed { arm, n, policy }))
}

/// Feeds a finished attempt of an `arm` request to the side policies; `true` when the live
/// policy learns from it too (live-arm requests only).
impl Arms {
    pub fn observe_attempt(&self, arm: Arm, obs: &AttemptObservation<'_>) -> bool {
        if let (Arm::Candidate, Some(r)) = (arm, &self.rollout) {
            r.policy.observe(|| Observation::attempt(obs));
            return false;
        }
        if let Some(shadow) = &self.shadow {
            shadow.policy.observe(|| Observation::attempt(obs));
        }
        true
    }

    /// Feeds a quality score to the side policies and the rollout's statistics; `true` when
    /// the live policy learns from it too (the request was not the candidate's), and the
    /// rollback the score set off, if it did.
    pub fn observe_quality(
        &self,
        iface: &str,
        request_id: &str,
        obs: &QualityObservation<'_>,
        now_unix_ms: f64,
    ) -> (bool, Option<RolloutEnd>) {
        let arms = self;
        let mut arm = Arm::Live;
        let mut ended = None;
        if let Some(r) = &arms.rollout {
            if let Ok(mut stats) = r.stats.lock() {
                if stats.candidate_requests.iter().any(|id| id == request_id) {
                    arm = Arm::Candidate;
                }
                if stats.status == RolloutStatus::Running {
                    stats.unquality[arm as usize].push(1.0 - obs.quality);
                    ended = r.check(iface, &mut stats, now_unix_ms);
                }
            }
            if arm == Arm::Candidate {
                if let Ok(mut p) = r.policy.write() {
                    p.observe_quality(obs);
                    r.policy.learnt.fetch_add(1, Ordering::Relaxed);
                }
                return (false, ended);
            }
        }
        if let Some(shadow) = &arms.shadow {
            if let Ok(mut p) = shadow.policy.write() {
                p.observe_quality(obs);
                shadow.policy.learnt.fetch_add(1, Ordering::Relaxed);
            }
            if let Ok(mut window) = shadow.window.lock() {
                if let Some(r) = window
                    .iter_mut()
                    .rev()
                    .find(|r| r.request_id.as_deref() == Some(request_id))
                {
                    r.quality = Some(obs.quality);
                }
            }
        }
        (true, ended)
    }

    /// Books the end of a request: its outcome in the shadow's window and the rollout's
    /// statistics (a client's own error counts for neither arm), then checks the guard; the
    /// rollback, when it fires, for the other instances.
    pub fn finish(
        &self,
        iface: &str,
        request_id: &str,
        routed: Routed,
        status: RequestStatus,
        now_unix_ms: f64,
    ) -> Option<RolloutEnd> {
        let bad = match status {
            RequestStatus::Succeeded { .. } => Some(false),
            RequestStatus::DeadlineExceeded | RequestStatus::Exhausted => Some(true),
            RequestStatus::ClientError { .. } => None,
        };
        if let (Arm::Live, Some(shadow)) = (routed.arm, &self.shadow) {
            if let Ok(mut window) = shadow.window.lock() {
                if let Some(r) = window.iter_mut().rev().find(|r| r.n == routed.n) {
                    r.request_id = Some(request_id.to_owned());
                    r.bad = bad;
                }
            }
        }
        let r = self.rollout.as_ref()?;
        let mut stats = r.stats.lock().ok()?;
        if routed.arm == Arm::Candidate {
            if stats.candidate_requests.len() == MAX_CANDIDATE_REQUESTS {
                stats.candidate_requests.pop_front();
            }
            stats.candidate_requests.push_back(request_id.to_owned());
        }
        if let (Some(bad), RolloutStatus::Running) = (bad, &stats.status) {
            stats.bad[routed.arm as usize].push(f64::from(u8::from(bad)));
            return r.check(iface, &mut stats, now_unix_ms);
        }
        None
    }
}

impl Rollout {
    /// The guards of both metrics; the error budget `1 − confidence` is split between them.
    fn guards(&self) -> [(&'static str, Guard); 2] {
        let g: GuardConfig = self.config.guard;
        let alpha = (1.0 - g.confidence) / 2.0;
        // Each arm's sequence runs at alpha/2 (see `Guard::compare`).
        let rho = mixing_precision(g.tuned_for, alpha / 2.0);
        [
            (
                "bad_rate",
                Guard {
                    margin: g.bad_rate_margin,
                    alpha,
                    rho,
                },
            ),
            (
                "quality",
                Guard {
                    margin: g.quality_margin,
                    alpha,
                    rho,
                },
            ),
        ]
    }

    fn comparisons(&self, stats: &RolloutStats) -> [(&'static str, Comparison); 2] {
        let [(bn, bg), (qn, qg)] = self.guards();
        [
            (bn, bg.compare(&stats.bad[1], &stats.bad[0])),
            (qn, qg.compare(&stats.unquality[1], &stats.unquality[0])),
        ]
    }

    /// Rolls back when a guard fires (called under the statistics' lock after each update);
    /// returns the rollback for the other instances.
    fn check(&self, iface: &str, stats: &mut RolloutStats, now_unix_ms: f64) -> Option<RolloutEnd> {
        if stats.status != RolloutStatus::Running {
            return None;
        }
        for (i, (metric, c)) in self.comparisons(stats).into_iter().enumerate() {
            if !c.worse {
                continue;
            }
            self.active.store(false, Ordering::Relaxed);
            self.events[i].fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                interface = iface,
                candidate = self.policy.kind.as_str(),
                metric,
                candidate_requests = c.candidate.n,
                live_requests = c.live.n,
                candidate_mean = c.candidate.mean(),
                live_mean = c.live.mean(),
                difference_low = c.difference.low,
                difference_high = c.difference.high,
                margin = if i == 0 {
                    self.config.guard.bad_rate_margin
                } else {
                    self.config.guard.quality_margin
                },
                confidence = self.config.guard.confidence,
                "canary rolled back: every request goes to the live policy again"
            );
            stats.status = RolloutStatus::RolledBack {
                metric,
                evidence: c,
                at_unix_ms: now_unix_ms,
            };
            return stats.status.shared(self.policy.kind.as_str());
        }
        None
    }

    /// Stops the rollout by an operator's decision (`promote`, else abort); returns the end
    /// for the other instances.
    ///
    /// # Errors
    /// The rollout is not running (the message says its state).
    pub fn end(&self, iface: &str, promote: bool, now_unix_ms: f64) -> Result<RolloutEnd, String> {
        let mut stats = self.stats.lock().map_err(|_| "poisoned".to_owned())?;
        if stats.status != RolloutStatus::Running {
            return Err(format!(
                "the rollout is {}, not running: only a running rollout can be promoted or aborted",
                stats.status.name()
            ));
        }
        self.active.store(false, Ordering::Relaxed);
        let evidence = self.comparisons(&stats);
        let (event, status) = if promote {
            (
                2,
                RolloutStatus::Promoted {
                    at_unix_ms: now_unix_ms,
                },
            )
        } else {
            (
                3,
                RolloutStatus::Aborted {
                    at_unix_ms: now_unix_ms,
                },
            )
        };
        self.events[event].fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            interface = iface,
            candidate = self.policy.kind.as_str(),
            action = EVENTS[event],
            candidate_requests = evidence[0].1.candidate.n,
            live_requests = evidence[0].1.live.n,
            bad_rate_difference_low = evidence[0].1.difference.low,
            bad_rate_difference_high = evidence[0].1.difference.high,
            quality_scores = evidence[1].1.candidate.n,
            "canary ended by an operator"
        );
        stats.status = status;
        stats
            .status
            .shared(self.policy.kind.as_str())
            .ok_or_else(|| "the rollout is still running".to_owned())
    }

    /// The rollout's state for the admin route.
    #[must_use]
    pub fn report(&self) -> Value {
        let Ok(stats) = self.stats.lock() else {
            return Value::Null;
        };
        let arm = |i: usize| {
            json!({
                "requests": stats.bad[i].n,
                "bad_outcomes": stats.bad[i].sum,
                "bad_rate": stats.bad[i].mean(),
                "quality_scores": stats.unquality[i].n,
                "mean_quality": stats.unquality[i].mean().map(|m| 1.0 - m),
            })
        };
        let guards: Vec<Value> = self
            .comparisons(&stats)
            .iter()
            .zip(self.guards())
            .map(|((metric, c), (_, g))| {
                // Quality is compared as 1 − quality: report live − candidate in its own terms.
                json!({
                    "metric": metric,
                    "margin": g.margin,
                    "difference": if *metric == "quality" { "live - candidate" } else { "candidate - live" },
                    "interval": [c.difference.low, c.difference.high],
                    "worse_beyond_margin": c.worse,
                })
            })
            .collect();
        let status = match &stats.status {
            RolloutStatus::RolledBack {
                metric,
                evidence,
                at_unix_ms,
            } => json!({
                "state": "rolled_back", "metric": metric, "at_unix_ms": at_unix_ms,
                "evidence": {"interval": [evidence.difference.low, evidence.difference.high], "candidate_n": evidence.candidate.n, "live_n": evidence.live.n},
            }),
            RolloutStatus::Promoted { at_unix_ms } | RolloutStatus::Aborted { at_unix_ms } => {
                json!({"state": stats.status.name(), "at_unix_ms": at_unix_ms})
            }
            RolloutStatus::Running => json!({"state": "running"}),
        };
        let mut status = status;
        if stats.status != RolloutStatus::Running {
            status["decided_by"] = json!(if stats.ended_elsewhere {
                "another_instance"
            } else {
                "this_instance"
            });
        }
        json!({
            "candidate_policy": self.policy.kind.as_str(),
            "percent": self.config.percent,
            "session_header": SESSION_HEADER,
            "status": status,
            "confidence": self.config.guard.confidence,
            "arms": {"live": arm(0), "candidate": arm(1)},
            "guards": guards,
            "candidate_learnt": self.policy.learnt.load(Ordering::Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::fnv1a;

    #[test]
    fn the_session_hash_is_fnv1a() {
        // The published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
