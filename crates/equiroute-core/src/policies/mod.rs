//! Routing policies: one trait, one file per policy, one way to build any of them by name.
//!
//! | name | what it ranks by |
//! |---|---|
//! | `lqm` | LQM-ContextRoute: `û/(1+τ̂/L_ref) + α·sqrt(xᵀA⁻¹x)/(1+λΔ)` |
//! | `ts-deadline` | deadline-risk Thompson sampling: sampled `P(bad)` and cost |
//! | `lqm-ts` | ours: contextual quality per service cycle × P(good) per unit of cost |
//! | `sw-ucb` | sliding-window UCB on the scalar reward (quality) |
//! | `linucb` | disjoint LinUCB on quality, latency ignored |
//! | `additive` | LinUCB on `α·u − (1−α)·τ̃` |
//! | `priority-cooldown` | a fixed order; candidates cool down after `allowed_fails` |
//! | `round-robin`, `random`, `static` | rotation, uniform shuffle, one fixed candidate first |
//! | `least-latency`, `least-busy`, `cheapest` | latency EMA, in-flight count, price among healthy |
//! | `oracle` | true expected values supplied by the laboratory (for regret) |
//!
//! Any of them can be wrapped in an [`ExplorationFloor`] (`min_propensity`), and every one
//! reports its first-choice distribution ([`Policy::first_choice_distribution`]) for
//! off-policy evaluation ([`crate::ope`]).

mod additive;
mod config;
mod floor;
mod heads;
mod lqm;
mod lqm_ts;
mod observation;
mod priority_cooldown;
mod risk;
mod simple;
mod sw_ucb;
mod ts_deadline;

pub use crate::estimators::shift::{ShiftConfig, ShiftDirection};
pub use additive::{Additive, AdditiveConfig};
pub use config::{NoParams, PolicyConfig, PolicyKind};
pub use floor::{ExplorationFloor, ExplorationFloorConfig};
pub use heads::{HeadsState, LinUcbPolicy, LinUcbPolicyConfig, Watch};
pub use lqm::{LatencyTerm, Lqm, LqmConfig, LqmState};
pub use lqm_ts::{CheapAgainst, CheapWarmup, LqmTs, LqmTsConfig, LqmTsObjective, LqmTsState};
pub use observation::Observation;
pub use priority_cooldown::{CooldownState, PriorityCooldown, PriorityCooldownConfig};
pub use risk::{
    CensoredTail, CostObjective, Level, RiskConfig, RiskModel, RiskSample, RiskState, SliceStats,
};
pub use simple::{
    Cheapest, CheapestConfig, EmaState, HealthState, LeastBusy, LeastLatency, LeastLatencyConfig,
    Oracle, RandomOrder, RoundRobin, Static, StaticConfig,
};
pub use sw_ucb::{Reward, SwUcb, SwUcbConfig, SwUcbState};
pub use ts_deadline::{TsDeadline, TsDeadlineConfig};

use crate::decision::{AttemptOutcome, Candidate, Millis, SlicePath, Timestamp, TokenEstimate};
use crate::error::StateError;
use rand::RngCore;
use serde::{Deserialize, Serialize};

/// What a policy sees when it ranks one request.
#[derive(Clone, Copy, Debug)]
pub struct RankContext<'a> {
    /// All candidates of the interface (indices below refer to this slice).
    pub candidates: &'a [Candidate],
    /// Indices of the eligible candidates, in configuration order.
    pub eligible: &'a [usize],
    /// The request's feature vector (dimension checked by the caller).
    pub features: &'a [f64],
    /// The request's deadline, if any.
    pub deadline: Option<Millis>,
    /// The statistics slice of the request.
    pub slice: SlicePath,
    /// Expected token counts, for per-token prices.
    pub tokens: TokenEstimate,
    /// In-flight attempts per candidate (for `least-busy`).
    pub in_flight: Option<&'a [u32]>,
    /// The current time.
    pub now: Timestamp,
    /// True expected value per candidate for this request (laboratory only, for `oracle`).
    pub oracle_values: Option<&'a [f64]>,
}

impl<'a> RankContext<'a> {
    /// A context with no deadline, the root slice, time 0 and no token estimate.
    #[must_use]
    pub fn new(candidates: &'a [Candidate], eligible: &'a [usize], features: &'a [f64]) -> Self {
        RankContext {
            candidates,
            eligible,
            features,
            deadline: None,
            slice: SlicePath::root(),
            tokens: TokenEstimate::default(),
            in_flight: None,
            now: Timestamp(0.0),
            oracle_values: None,
        }
    }

    /// The expected cost of a call to candidate `i`.
    #[must_use]
    pub fn expected_cost(&self, i: usize) -> f64 {
        self.candidates[i].price.cost(self.tokens).0
    }
}

/// The per-candidate numbers behind a score, for the audit log and the state endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ScoreBreakdown {
    /// Estimated quality `û`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quality: Option<f64>,
    /// Exploration bonus added to the score.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exploration: Option<f64>,
    /// Latency estimate in ms (EMA or posterior median).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<f64>,
    /// `latency_ms` is the prior: no answer of the candidate was observed yet (the dashboard
    /// says "no data yet" rather than show the prior as a typical latency).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub latency_unseen: bool,
    /// Estimated provider-failure probability.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_probability: Option<f64>,
    /// Sampled probability of missing the deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_miss_probability: Option<f64>,
    /// Sampled `P(bad) = P(fail) + (1−P(fail))·P(L>d)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bad_probability: Option<f64>,
    /// Expected cost of the call in USD.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    /// The candidate was held back from exploration by a guardrail (ranked last).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub guarded: bool,
    /// The candidate was moved first to collect its first quality observations.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub warmup: bool,
    /// The candidate was moved first to re-test a quality level it lost in a detected drop
    /// (`lqm-ts`'s re-test rule).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retest: bool,
}

/// A change in a candidate's quality scores that a policy detected (`lqm-ts`'s `shift`
/// detector), for the caller to log and count ([`Policy::take_quality_shifts`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct QualityShift {
    /// Index into the interface's candidates.
    pub candidate: usize,
    pub direction: ShiftDirection,
    /// The candidate's mean score before the change (its head's, over its window).
    pub from: f64,
    /// The mean of the scores since the change's estimated start.
    pub to: f64,
    /// How many scores that is: the evidence kept, everything before it discarded.
    pub scores: u64,
    /// When the score that set it off was learnt.
    pub at: Timestamp,
}

/// The most detected shifts a policy keeps for [`Policy::take_quality_shifts`] between two
/// calls; older ones are dropped.
pub const MAX_PENDING_SHIFTS: usize = 64;

/// One ranked candidate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScoredCandidate {
    /// Index into [`RankContext::candidates`].
    pub index: usize,
    /// The policy's score (higher is better); always finite.
    pub score: f64,
    pub breakdown: ScoreBreakdown,
}

/// A policy's answer: the eligible candidates, best first (the fallback order).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Ranking {
    pub order: Vec<ScoredCandidate>,
    /// Probability with which the first choice was picked and how it is known, where the
    /// policy says (1 and deterministic for deterministic policies, 1/K and exact for uniform
    /// random; Thompson policies estimate it by re-sampling when `propensity_samples > 0`).
    pub propensity: Option<Propensity>,
    /// How many candidates at the head of `order` the policy holds as good as one another
    /// for this request, so that falling over from the first to the next of them loses
    /// nothing but the price difference (`lqm-ts`'s top group once quality is learnt; 0:
    /// no such claim, the default). The executor falls over to them rather than wait out a
    /// `Retry-After` ([`crate::executor::Execution::with_interchangeable`]).
    #[serde(skip)]
    pub interchangeable: usize,
}

/// The probability with which a ranking's first choice was picked, and how it is known: what
/// the audit log records for off-policy evaluation. It travels with the [`Ranking`], so a
/// request ranked by a canary's or a floored policy reports that policy's kind.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Propensity {
    pub probability: f64,
    pub kind: PropensityKind,
}

impl Propensity {
    /// A deterministic policy's choice: probability 1 by construction.
    pub const DETERMINISTIC: Propensity = Propensity {
        probability: 1.0,
        kind: PropensityKind::Deterministic,
    };

    /// A probability the policy defines.
    #[must_use]
    pub fn exact(probability: f64) -> Propensity {
        Propensity {
            probability,
            kind: PropensityKind::Exact,
        }
    }

    /// The share of `draws` re-drawn rankings whose first choice was the same.
    #[must_use]
    pub fn estimated(hits: usize, draws: u32) -> Propensity {
        Propensity {
            probability: hits as f64 / f64::from(draws.max(1)),
            kind: PropensityKind::Estimated { draws },
        }
    }

    /// True for a deterministic policy's "probability 1".
    #[must_use]
    pub fn is_deterministic(&self) -> bool {
        self.kind == PropensityKind::Deterministic
    }

    /// The kind's name in the audit log: `exact`, `estimated` or `deterministic`.
    #[must_use]
    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            PropensityKind::Exact => "exact",
            PropensityKind::Estimated { .. } => "estimated",
            PropensityKind::Deterministic => "deterministic",
        }
    }
}

impl Ranking {
    /// The probability with which the first choice was picked, where the policy says.
    #[must_use]
    pub fn first_choice_probability(&self) -> Option<f64> {
        self.propensity.map(|p| p.probability)
    }

    /// Candidate indices in ranked order.
    pub fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        self.order.iter().map(|s| s.index)
    }

    /// Sorts by score, best first; ties keep eligibility order (stable sort).
    pub(crate) fn sort(&mut self) {
        self.order.sort_by(|a, b| b.score.total_cmp(&a.score));
    }
}

/// How a [`FirstChoice`] distribution was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PropensityKind {
    /// The policy defines the probabilities (uniform random, an exploration floor).
    Exact,
    /// Estimated from this many independent rankings (Thompson-sampled policies).
    Estimated { draws: u32 },
    /// A deterministic policy: probability 1 on its choice "by construction". Logs of such a
    /// policy only support evaluating policies that agree with it.
    Deterministic,
}

/// A policy's first-choice probabilities for one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FirstChoice {
    /// Indexed like [`RankContext::candidates`]; 0 for ineligible candidates; sums to 1 over
    /// the eligible ones (all 0 when none is eligible).
    pub probabilities: Vec<f64>,
    pub kind: PropensityKind,
}

impl FirstChoice {
    /// Probability 1 on the first of `ranking` (a deterministic policy's answer).
    #[must_use]
    pub fn deterministic(ctx: &RankContext<'_>, ranking: &Ranking) -> FirstChoice {
        let mut probabilities = vec![0.0; ctx.candidates.len()];
        if let Some(first) = ranking.order.first() {
            probabilities[first.index] = 1.0;
        }
        FirstChoice {
            probabilities,
            kind: PropensityKind::Deterministic,
        }
    }

    /// Uniform over `set` (exact).
    #[must_use]
    pub fn uniform(ctx: &RankContext<'_>, set: &[usize]) -> FirstChoice {
        let mut probabilities = vec![0.0; ctx.candidates.len()];
        for &i in set {
            probabilities[i] = 1.0 / set.len() as f64;
        }
        FirstChoice {
            probabilities,
            kind: PropensityKind::Exact,
        }
    }

    /// The share of `draws` (at least 1) independent first choices that fell on each
    /// candidate.
    pub fn from_draws(
        ctx: &RankContext<'_>,
        draws: u32,
        mut first: impl FnMut() -> Option<usize>,
    ) -> FirstChoice {
        let draws = draws.max(1);
        let mut probabilities = vec![0.0; ctx.candidates.len()];
        for _ in 0..draws {
            if let Some(i) = first() {
                probabilities[i] += 1.0 / f64::from(draws);
            }
        }
        FirstChoice {
            probabilities,
            kind: PropensityKind::Estimated { draws },
        }
    }

    /// The probability that candidate `i` goes first (0 outside the interface).
    #[must_use]
    pub fn probability(&self, i: usize) -> f64 {
        self.probabilities.get(i).copied().unwrap_or(0.0)
    }

    /// False for a deterministic policy, whose "probability 1" holds by construction.
    #[must_use]
    pub fn is_stochastic(&self) -> bool {
        self.kind != PropensityKind::Deterministic
    }
}

/// One finished attempt, as the policy learns from it.
#[derive(Clone, Copy, Debug)]
pub struct AttemptObservation<'a> {
    pub candidate: usize,
    pub features: &'a [f64],
    pub slice: SlicePath,
    pub deadline: Option<Millis>,
    pub outcome: &'a AttemptOutcome,
    pub now: Timestamp,
}

/// A delayed quality score for the attempt that answered a request.
#[derive(Clone, Copy, Debug)]
pub struct QualityObservation<'a> {
    pub candidate: usize,
    /// The features of the request the score is about (kept with the pending decision).
    pub features: &'a [f64],
    /// Quality in `[0, 1]`.
    pub quality: f64,
    /// Latency of the attempt that answered (the additive baseline needs it).
    pub latency: Millis,
    pub now: Timestamp,
}

/// A boxed copy of a policy (implemented for every `Clone` policy): lets the gateway build a
/// new view of shared state beside the one serving requests, then swap it in.
pub trait PolicyClone {
    /// A copy of this policy with the same configuration and state.
    fn clone_box(&self) -> Box<dyn Policy>;
}

impl<T: Policy + Clone + 'static> PolicyClone for T {
    fn clone_box(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }
}

/// A routing policy. Ranking reads state (`&self`) so the gateway can rank from a shared
/// snapshot; observations mutate it.
pub trait Policy: PolicyClone + Send + Sync + std::fmt::Debug {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;

    /// Ranks the eligible candidates of `ctx`, best first. The result is a permutation of
    /// `ctx.eligible` with finite scores.
    fn rank(&self, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> Ranking;

    /// First-choice probabilities over `ctx.candidates` (0 for ineligible), exact where the
    /// policy defines them, else estimated from `draws` independent rankings; also says
    /// which. Does not change the policy's state (round-robin's rotation included). The
    /// default: a policy whose ranking says its propensity is deterministic is one-hot; any other is estimated from `draws` calls to
    /// [`Policy::rank`]. Policies with exact probabilities, or a state that ranking moves,
    /// override it.
    fn first_choice_distribution(
        &self,
        ctx: &RankContext<'_>,
        rng: &mut dyn RngCore,
        draws: u32,
    ) -> FirstChoice {
        let ranking = self.rank(ctx, rng);
        if ranking.propensity.is_some_and(|p| p.is_deterministic()) {
            return FirstChoice::deterministic(ctx, &ranking);
        }
        FirstChoice::from_draws(ctx, draws, || {
            self.rank(ctx, rng).order.first().map(|s| s.index)
        })
    }

    /// Learns from one attempt (every attempt, failed ones included).
    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>);

    /// Learns from a delayed quality score.
    fn observe_quality(&mut self, obs: &QualityObservation<'_>);

    /// The candidate's circuit breaker saw it recover at `now` (its half-open probes
    /// succeeded after an open period): a detected change, so a policy with a failure belief
    /// discards the evidence from before it ([`Observation::Recovered`]). Nothing by default.
    fn recovered(&mut self, _candidate: usize, _now: Timestamp) {}

    /// The learning state, for persistence and sharing.
    fn export_state(&self) -> PolicyState;

    /// Adds another instance's state: afterwards this policy holds the statistics of both
    /// observation streams.
    ///
    /// # Errors
    /// The state belongs to another policy or another shape of interface.
    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError>;

    /// The point estimate (no sampling) of `P(latency > deadline)` for `candidate` under
    /// `ctx`'s deadline, for calibration and display; `None` for policies without a latency
    /// model, or without a deadline.
    fn deadline_miss_estimate(&self, _candidate: usize, _ctx: &RankContext<'_>) -> Option<f64> {
        None
    }

    /// What the policy believes about `candidate`'s latency and failure rate under `ctx`
    /// (its slice, at its time), for the hedge delay ([`crate::hedge`]); `None` for policies
    /// without a latency model.
    fn latency_outlook(
        &self,
        _candidate: usize,
        _ctx: &RankContext<'_>,
    ) -> Option<crate::hedge::LatencyOutlook> {
        None
    }

    /// Statistics slices evicted (to keep them under their cap) since the last call; 0 for
    /// policies without slices.
    fn take_slice_evictions(&mut self) -> u64 {
        0
    }

    /// Quality shifts detected since the last call, oldest first (at most
    /// [`MAX_PENDING_SHIFTS`]); none for policies without change detection.
    fn take_quality_shifts(&mut self) -> Vec<QualityShift> {
        Vec::new()
    }

    /// How many quality scores each candidate's quality estimate rests on (delayed scores,
    /// and failures when the policy teaches them as a score), indexed like the candidates;
    /// `None` for policies without a learnt quality estimate. Before any score, the
    /// estimate in [`ScoreBreakdown::quality`] is only the prior.
    fn quality_observations(&self) -> Option<Vec<u64>> {
        None
    }
}

/// Exported learning state of any policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "kebab-case")]
pub enum PolicyState {
    Lqm(LqmState),
    TsDeadline(RiskState),
    LqmTs(LqmTsState),
    SwUcb(SwUcbState),
    Linucb(HeadsState),
    Additive(HeadsState),
    PriorityCooldown(CooldownState),
    LeastLatency(EmaState),
    Cheapest(HealthState),
    /// Policies that learn nothing (`round-robin`, `random`, `static`, `least-busy`, `oracle`).
    Stateless {
        kind: PolicyKind,
    },
}

impl PolicyState {
    /// The policy this state belongs to.
    #[must_use]
    pub fn kind(&self) -> PolicyKind {
        match self {
            PolicyState::Lqm(_) => PolicyKind::Lqm,
            PolicyState::TsDeadline(_) => PolicyKind::TsDeadline,
            PolicyState::LqmTs(_) => PolicyKind::LqmTs,
            PolicyState::SwUcb(_) => PolicyKind::SwUcb,
            PolicyState::Linucb(_) => PolicyKind::Linucb,
            PolicyState::Additive(_) => PolicyKind::Additive,
            PolicyState::PriorityCooldown(_) => PolicyKind::PriorityCooldown,
            PolicyState::LeastLatency(_) => PolicyKind::LeastLatency,
            PolicyState::Cheapest(_) => PolicyKind::Cheapest,
            PolicyState::Stateless { kind } => *kind,
        }
    }
}

pub(crate) fn wrong_policy(expected: PolicyKind, found: &PolicyState) -> StateError {
    StateError::WrongPolicy {
        expected: expected.as_str().to_owned(),
        found: found.kind().as_str().to_owned(),
    }
}

pub(crate) fn check_len(what: &str, mine: usize, theirs: usize) -> Result<(), StateError> {
    if mine == theirs {
        Ok(())
    } else {
        Err(StateError::Shape {
            what: format!("{what}: {mine} here, {theirs} in the merged state"),
        })
    }
}
