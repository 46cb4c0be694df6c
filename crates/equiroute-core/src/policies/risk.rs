//! The deadline-risk model shared by `ts-deadline` and `lqm-ts`: an EWMA failure rate per
//! candidate and a Normal-Inverse-Gamma log-latency posterior per candidate and statistics
//! slice, sampled Thompson-style into `P(bad) = P(fail) + (1−P(fail))·P(L>d)`.
//!
//! **Slices.** Latency is kept per candidate at every level of the request's [`SlicePath`]
//! (all requests → task class → deadline class → streaming and input size). A level borrows
//! strength from the level above explicitly: its effective statistics are the parent's
//! effective statistics capped at `borrow_strength` pseudo-observations, merged with its own.
//! A new slice therefore starts from its parent's belief and is dominated by its own data
//! after a few dozen observations. Failures are per candidate (a rate limit hits every slice).
//!
//! **Bounded.** Slice keys come from request labels (a client's task class), so the slices
//! are bounded twice: by the bytes of the table that holds them (`max_slice_bytes`, every
//! entry's key, statistics and hash-table share; a task class is hashed into its key, never
//! stored) and by their number beyond the roots (`max_slices`). When a new slice finds no
//! room, the least useful eighth is evicted in one pass (amortised O(8) per new slice): the
//! slices of classed requests before those of requests without a task class, then least
//! decayed weight, i.e. fewest recent observations, oldest first on ties. So a flood of
//! invented classes evicts its own slices and leaves an unclassed request's statistics alone.
//! An evicted slice is dropped, not folded into its parent: every observation already fed
//! each level of its path, so the parent holds the child's data and folding it in would
//! count it twice. The root (all requests of a candidate) is never evicted.

use crate::decision::{AttemptStatus, SlicePath, Timestamp};
use crate::estimators::decay_factor;
use crate::estimators::ewma::{FailureRate, FailureRateConfig};
use crate::estimators::nig::{bad_outcome_probability, LogLatencyStats, NigPosterior, NigPrior};
use crate::estimators::shape::{Exceedance, LatencyBelief};
use crate::hash::KeyHasher;
use crate::StateError;
use rand::RngCore;
use rand_distr::Distribution;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use super::{check_len, AttemptObservation, RankContext};

/// How cost enters the ranking of `ts-deadline` (the reference leaves it open; ours is
/// explicit). `C_ref` is `cost_ref_usd` or, when unset, the mean expected cost of the
/// eligible candidates of the request.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum CostObjective {
    /// Maximise `(1 − P(bad)) / (1 + cost/C_ref)`: good outcomes per unit of spend, where
    /// every call costs one overhead unit plus its price in units of `C_ref`.
    CostPerGood { cost_ref_usd: Option<f64> },
    /// The cheapest candidate whose sampled `P(bad)` is at most `max_bad`; the rest after it,
    /// by sampled `P(bad)`.
    RiskBudget { max_bad: f64 },
    /// Lowest sampled `P(bad)`, cost ignored.
    MinRisk,
}

impl Default for CostObjective {
    fn default() -> Self {
        CostObjective::CostPerGood { cost_ref_usd: None }
    }
}

impl CostObjective {
    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        match *self {
            CostObjective::CostPerGood {
                cost_ref_usd: Some(c),
            } => crate::error::positive("objective.cost_ref_usd", c).map(|_| ()),
            CostObjective::RiskBudget { max_bad } => {
                crate::error::unit_interval("objective.max_bad", max_bad).map(|_| ())
            }
            _ => Ok(()),
        }
    }
}

/// Parameters of the risk model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RiskConfig {
    /// Prior of the log-latency posterior.
    pub latency_prior: NigPrior,
    /// Half-life of latency observations in ms (`None`: no decay).
    pub latency_half_life_ms: Option<f64>,
    /// Failure-rate EWMA.
    pub failure: FailureRateConfig,
    /// Number of slice levels used (1 = no slicing, up to 4).
    pub slice_depth: usize,
    /// Pseudo-observations a slice borrows from its parent.
    pub borrow_strength: f64,
    /// A candidate whose point-estimate `P(bad)` exceeds this is not explored: it is ranked
    /// after every other candidate (still available as a last fallback).
    pub exploration_guard: f64,
    /// Weight `β` of the newest call in the fast latency [`Level`] (0, the default of the
    /// reference design, turns it off; `lqm-ts` uses 0.3).
    pub level_beta: f64,
    /// Half-life in ms of the trust in the fast level once calls stop.
    pub level_half_life_ms: f64,
    /// Evidence the fast level needs before it moves the location, in standard errors `z`
    /// of its EMA under "no shift" (`σ·sqrt(β/(2−β))`, `σ²` the posterior's): the shift is
    /// the level soft-thresholded by `z` of them (0, the default: the level as it is).
    pub level_z: f64,
    /// Most (candidate, slice) latency statistics kept beyond each candidate's root; the
    /// least useful are evicted to make room (see the module doc).
    pub max_slices: usize,
    /// Most bytes of the table holding the latency statistics, roots included (about
    /// [`RiskModel::SLICE_ENTRY_BYTES`] per (candidate, slice)); the least useful slices are
    /// evicted to stay within it (see the module doc).
    pub max_slice_bytes: usize,
    /// Half-life in ms of a candidate's evidence while it goes untried (`None`: off). See
    /// [`RiskModel::freshness`]: a belief formed during an outage or a spike fades toward the
    /// prior, and the failure rate is drawn from its widening Beta posterior, so the candidate
    /// is tried again. Attempts of every kind (breaker half-open probes too) refresh it.
    pub stale_half_life_ms: Option<f64>,
    /// The half-life of a stale belief's latency part (posterior and histogram, and in
    /// `lqm-ts` the quality part's latency estimate `τ̂`) alone; absent (or `null`):
    /// `stale_half_life_ms`.
    pub stale_latency_half_life_ms: Option<f64>,
    /// The half-life of a stale belief's failure part (the counts behind the Beta draw)
    /// alone; absent (or `null`): `stale_half_life_ms`.
    pub stale_failure_half_life_ms: Option<f64>,
    /// Pseudo-observations `n₀` of the log-normal posterior against each slice's latency
    /// histogram: `P(L>d) = (n₀·P_nig + M(>d))/(n₀ + M)` (see [`crate::estimators::shape`]).
    /// `None`: the log-normal alone, as the reference design.
    pub shape_prior_weight: Option<f64>,
    /// Where a censored latency's mass goes in the histogram (see [`CensoredTail`]).
    pub censored_tail: CensoredTail,
}

/// How a censored latency ("at least `c`": a timeout, a hedge's cancelled loser) enters the
/// latency histogram. The NIG sums impute it from the log-normal either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CensoredTail {
    /// Spread above `c` as the log-normal point estimate truncated at `c`: a heavy tail's
    /// censored mass lands too close to `c`.
    #[default]
    LogNormal,
    /// Spread above `c` as the slice's blended belief is there (histogram and log-normal,
    /// [`crate::estimators::shape::LatencyHistogram::tail_shares`]): follows the observed
    /// tail (redistribution to the right).
    Belief,
}

impl Default for RiskConfig {
    fn default() -> Self {
        RiskConfig {
            latency_prior: NigPrior::default(),
            latency_half_life_ms: Some(600_000.0),
            failure: FailureRateConfig::default(),
            slice_depth: SlicePath::MAX_DEPTH,
            borrow_strength: 20.0,
            exploration_guard: 0.6,
            level_beta: 0.0,
            level_half_life_ms: 30_000.0,
            level_z: 0.0,
            max_slices: RiskConfig::DEFAULT_MAX_SLICES,
            max_slice_bytes: RiskConfig::DEFAULT_MAX_SLICE_BYTES,
            stale_half_life_ms: Some(RiskConfig::DEFAULT_STALE_HALF_LIFE_MS),
            stale_latency_half_life_ms: None,
            stale_failure_half_life_ms: None,
            shape_prior_weight: Some(RiskConfig::DEFAULT_SHAPE_PRIOR_WEIGHT),
            censored_tail: CensoredTail::LogNormal,
        }
    }
}

impl RiskConfig {
    /// The default of [`RiskConfig::max_slices`].
    pub const DEFAULT_MAX_SLICES: usize = 4096;
    /// The default of [`RiskConfig::max_slice_bytes`]: 2 MiB, room for 3,584 (candidate,
    /// slice) statistics.
    pub const DEFAULT_MAX_SLICE_BYTES: usize = 2 << 20;
    /// The least [`RiskConfig::max_slice_bytes`] accepted: a table of 56 entries.
    pub const MIN_MAX_SLICE_BYTES: usize = 64 << 10;
    /// The default of [`RiskConfig::stale_half_life_ms`] (docs/policies.md, "Beliefs that go
    /// stale").
    pub const DEFAULT_STALE_HALF_LIFE_MS: f64 = 120_000.0;
    /// The default of [`RiskConfig::shape_prior_weight`], chosen by calibration in the
    /// laboratory (docs/calibration.md).
    pub const DEFAULT_SHAPE_PRIOR_WEIGHT: f64 = 20.0;

    /// The half-life that fades a stale latency belief (`None`: it does not fade).
    #[must_use]
    pub fn stale_latency_half_life(&self) -> Option<f64> {
        self.stale_latency_half_life_ms.or(self.stale_half_life_ms)
    }

    /// The half-life that fades a stale failure belief (`None`: it does not fade, and the
    /// failure rate is the point estimate).
    #[must_use]
    pub fn stale_failure_half_life(&self) -> Option<f64> {
        self.stale_failure_half_life_ms.or(self.stale_half_life_ms)
    }

    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        self.latency_prior.validate()?;
        if let Some(h) = self.latency_half_life_ms {
            crate::error::positive("latency_half_life_ms", h)?;
        }
        for (field, h) in [
            ("stale_half_life_ms", self.stale_half_life_ms),
            (
                "stale_latency_half_life_ms",
                self.stale_latency_half_life_ms,
            ),
            (
                "stale_failure_half_life_ms",
                self.stale_failure_half_life_ms,
            ),
        ] {
            if let Some(h) = h {
                crate::error::positive(field, h)?;
            }
        }
        self.failure.validate()?;
        if !(1..=SlicePath::MAX_DEPTH).contains(&self.slice_depth) {
            return Err(crate::error::out_of_range(
                "slice_depth",
                self.slice_depth,
                "must be 1 (no slicing) to 4 (task, deadline class, streaming + input size)",
            ));
        }
        crate::error::non_negative("borrow_strength", self.borrow_strength)?;
        crate::error::unit_interval("exploration_guard", self.exploration_guard)?;
        crate::error::unit_interval("level_beta", self.level_beta)?;
        crate::error::positive("level_half_life_ms", self.level_half_life_ms)?;
        crate::error::non_negative("level_z", self.level_z)?;
        if let Some(w) = self.shape_prior_weight {
            crate::error::positive("shape_prior_weight", w)?;
        }
        if self.max_slices == 0 {
            return Err(crate::error::out_of_range(
                "max_slices",
                self.max_slices,
                "must be at least 1 (default 4096); set slice_depth = 1 to turn slicing off",
            ));
        }
        if self.max_slice_bytes < Self::MIN_MAX_SLICE_BYTES {
            return Err(crate::error::out_of_range(
                "max_slice_bytes",
                self.max_slice_bytes,
                "must be at least 65536 (64 KiB; default 2097152, 2 MiB); set slice_depth = 1 to turn slicing off",
            ));
        }
        Ok(())
    }
}

/// One Thompson draw of a candidate's risk.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RiskSample {
    pub failure: f64,
    pub exceedance: f64,
    pub bad: f64,
    /// Point-estimate `P(bad)` exceeded the exploration guard.
    pub guarded: bool,
    /// Posterior median latency in ms.
    pub median_ms: f64,
    /// No latency of the candidate was ever seen: `median_ms` is the prior's.
    pub latency_unseen: bool,
}

/// The fast latency level of a candidate: an EMA of how far its recent calls' log-latency sat
/// from what its (slow) posterior expected, `r ← (1−β)·r + β·(ln L − μ)`. Load moves a
/// provider's whole distribution within a few calls; the posterior, built to learn the shape
/// and the tail over minutes, follows slowly. The ranking shifts the posterior's location by
/// `w·r`, where the trust `w` halves every `level_half_life_ms` without a call. With
/// `level_z = z`, `r` must first stand out from the noise: an EMA of residuals of a provider
/// that has not moved has standard error `se = σ·sqrt(β/(2−β))`, and the shift is
/// `w·sign(r)·max(0, |r| − z·se)`, so a wide provider's noise moves the location little while
/// a spike of several `σ` still does within a few calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Level {
    /// EMA of the log-latency residuals.
    pub residual: f64,
    /// The newest call folded in.
    pub at: Timestamp,
}

impl Level {
    /// The location shift at `now`, for a provider whose log-latency has variance `sigma2`.
    #[must_use]
    pub fn shift(&self, now: Timestamp, cfg: &RiskConfig, sigma2: f64) -> f64 {
        let beta = cfg.level_beta;
        if beta <= 0.0 || self.residual == 0.0 {
            return 0.0;
        }
        let se = (sigma2.max(0.0) * beta / (2.0 - beta)).sqrt();
        let evident = (self.residual.abs() - cfg.level_z * se).max(0.0);
        evident.copysign(self.residual)
            * decay_factor(Some(cfg.level_half_life_ms), (now.0 - self.at.0).max(0.0))
    }

    fn observe(&mut self, now: Timestamp, residual: f64, cfg: &RiskConfig) {
        self.residual += cfg.level_beta * (residual - self.residual);
        if now.0 > self.at.0 {
            self.at = now;
        }
    }
}

/// Exported risk statistics.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RiskState {
    pub failures: Vec<FailureRate>,
    /// Fast latency level per candidate (absent in states exported before it existed).
    #[serde(default)]
    pub levels: Vec<Level>,
    /// Latency statistics per (candidate, slice key), sorted.
    pub slices: Vec<SliceStats>,
}

/// Latency statistics of one candidate in one slice.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SliceStats {
    pub candidate: u32,
    pub slice: u64,
    pub stats: LogLatencyStats,
    /// On the path of requests without a task class: evicted only after every classed slice
    /// (absent in states saved before it, until the slice is observed again).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unclassed: bool,
}

/// What the model keeps of one (candidate, slice).
#[derive(Clone, Copy, Debug, Default)]
struct Slice {
    stats: LogLatencyStats,
    /// See [`SliceStats::unclassed`].
    unclassed: bool,
}

type SliceMap = HashMap<(u32, u64), Slice, BuildHasherDefault<KeyHasher>>;

/// The key of the root slice (every other level's key is odd).
const ROOT: u64 = 0;

/// Failure rates and sliced latency posteriors of every candidate of an interface.
#[derive(Clone, Debug)]
pub struct RiskModel {
    cfg: RiskConfig,
    failures: Vec<FailureRate>,
    levels: Vec<Level>,
    latency: SliceMap,
    /// Slices evicted since [`RiskModel::take_evictions`] last read the count.
    evicted: u64,
    /// Per candidate: its last attempt was a rest ([`AttemptOutcome::is_rest`]). Kept in
    /// this process only (a rest is a matter of seconds).
    ///
    /// [`AttemptOutcome::is_rest`]: crate::decision::AttemptOutcome::is_rest
    rested: Vec<bool>,
}

impl RiskModel {
    /// A model over `k` candidates.
    #[must_use]
    pub fn new(k: usize, cfg: RiskConfig) -> RiskModel {
        RiskModel {
            cfg,
            failures: vec![FailureRate::default(); k],
            levels: vec![Level::default(); k],
            latency: SliceMap::default(),
            evicted: 0,
            rested: vec![false; k],
        }
    }

    /// Bytes of the slice table per entry it has room for: the key, the statistics and the
    /// table's control byte, at most 7/8 of its buckets used (`std`'s `HashMap`).
    pub const SLICE_ENTRY_BYTES: usize =
        (std::mem::size_of::<(u32, u64)>() + std::mem::size_of::<Slice>() + 1) * 8 / 7;

    /// Bytes of the table holding the latency statistics, roots included: what
    /// [`RiskConfig::max_slice_bytes`] bounds.
    #[must_use]
    pub fn slice_bytes(&self) -> usize {
        self.latency.capacity() * Self::SLICE_ENTRY_BYTES
    }

    /// How many (candidate, slice) statistics are kept beyond the candidates' roots.
    #[must_use]
    pub fn slice_count(&self) -> usize {
        // O(candidates), not O(slices): it runs for every new slice.
        let roots = (0..self.failures.len() as u32)
            .filter(|&i| self.latency.contains_key(&(i, ROOT)))
            .count();
        self.latency.len() - roots
    }

    /// The slices evicted since the last call (the gateway adds them to a counter).
    pub fn take_evictions(&mut self) -> u64 {
        std::mem::take(&mut self.evicted)
    }

    /// The statistics of candidate `i` in slice `key` (on an unclassed request's path when
    /// `unclassed`), made room for by count when new; [`Self::keep_within_bytes`] follows.
    fn slice_mut(&mut self, i: usize, key: u64, unclassed: bool) -> &mut LogLatencyStats {
        let id = (i as u32, key);
        if key != ROOT && !self.latency.contains_key(&id) {
            let cap = self.cfg.max_slices;
            if self.slice_count() >= cap {
                self.evict_to(cap - (cap / 8).max(1));
            }
        }
        let slice = self.latency.entry(id).or_default();
        slice.unclassed = unclassed;
        &mut slice.stats
    }

    /// Evicts the least useful eighth of the slices and gives the table's memory back until
    /// it fits `max_slice_bytes`. Runs after the slices are updated, not before a new one is
    /// added, because the table grows when it decides to (a removal leaves a tombstone that
    /// still takes room), and so that a new slice, just observed, is not the one evicted.
    /// The table doubles on growth: it exceeds the budget for that moment only.
    fn keep_within_bytes(&mut self) {
        while self.slice_bytes() > self.cfg.max_slice_bytes {
            // Rehashed with an eighth of room to grow (so that the next insertions do not
            // grow it again at once), a table that grew, or that a merge filled, may fit...
            let len = self.latency.len();
            self.latency.shrink_to(len + len / 8);
            if self.slice_bytes() <= self.cfg.max_slice_bytes {
                return;
            }
            // ...else the least useful eighth goes.
            let slices = self.slice_count();
            if slices == 0 {
                // Only roots: never evicted (the budget's minimum leaves room for them).
                return;
            }
            self.evict_to(slices - (slices / 8).max(1));
        }
    }

    /// Evicts the least useful slices (never a root) until at most `keep` remain: those of
    /// classed requests before those of unclassed ones, then by usefulness, the weight
    /// decayed to a common time, compared in log space (`ln w + ln 2·t/h`, the same order as
    /// `w·2^(−(now−t)/h)` for any `now`); ties go to the older slice.
    fn evict_to(&mut self, keep: usize) {
        type Rank = (bool, f64, f64, (u32, u64));
        let mut ranked: Vec<Rank> = self
            .latency
            .iter()
            .filter(|(&(_, key), _)| key != ROOT)
            .map(|(&id, s)| {
                let recency = self
                    .cfg
                    .latency_half_life_ms
                    .map_or(0.0, |h| std::f64::consts::LN_2 * s.stats.at.0 / h);
                let usefulness = s.stats.weight.max(f64::MIN_POSITIVE).ln() + recency;
                (s.unclassed, usefulness, s.stats.at.0, id)
            })
            .collect();
        if ranked.len() <= keep {
            return;
        }
        let drop = ranked.len() - keep;
        let order = |a: &Rank, b: &Rank| {
            a.0.cmp(&b.0)
                .then(a.1.total_cmp(&b.1))
                .then(a.2.total_cmp(&b.2))
                .then(a.3.cmp(&b.3))
        };
        ranked.select_nth_unstable_by(drop - 1, order);
        for (_, _, _, id) in &ranked[..drop] {
            self.latency.remove(id);
        }
        self.evicted += drop as u64;
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &RiskConfig {
        &self.cfg
    }

    /// The slice keys this model uses for a request: the path cut to `slice_depth`.
    fn used_levels<'s>(&self, slice: &'s SlicePath) -> &'s [u64] {
        let levels = slice.levels();
        &levels[..self.cfg.slice_depth.min(levels.len())]
    }

    /// Effective latency posterior of candidate `i` in `slice` at `now`, after borrowing
    /// strength down the slice path.
    #[must_use]
    pub fn posterior(&self, i: usize, slice: SlicePath, now: Timestamp) -> NigPosterior {
        self.effective(i, slice, now, false)
            .posterior(&self.cfg.latency_prior)
    }

    /// Effective statistics of candidate `i` in `slice` at `now`: the sums, and the histogram
    /// when `shape` (else left empty: the posterior reads only the sums).
    fn effective(
        &self,
        i: usize,
        slice: SlicePath,
        now: Timestamp,
        shape: bool,
    ) -> LogLatencyStats {
        let hl = self.cfg.latency_half_life_ms;
        // Levels are usually updated together, so one decay factor serves them all.
        let mut memo = (u64::MAX, 1.0);
        let mut effective = LogLatencyStats::default();
        for (level, &key) in self.used_levels(&slice).iter().enumerate() {
            let own = self.latency.get(&(i as u32, key)).map(|s| &s.stats);
            // What brings the level's own statistics to `now`, read in place (not copied).
            let pre = own.filter(|s| s.at.0 < now.0).map(|s| {
                // Keyed by the exact bits: the memo is for identical timestamps only.
                if s.at.0.to_bits() != memo.0 {
                    memo = (s.at.0.to_bits(), decay_factor(hl, now.0 - s.at.0));
                }
                (memo.1, now)
            });
            if level > 0 {
                effective.cap(self.cfg.borrow_strength, shape);
                if let Some(own) = own {
                    effective.merge_scaled(own, pre, hl, shape);
                }
                continue;
            }
            let Some(own) = own else { continue };
            // Without a decay, a copy: a number times 1 is itself, to the bit.
            let (f, at) = pre.unwrap_or((1.0, own.at));
            effective = own.scaled(f, at, shape);
        }
        effective
    }

    /// What the ranking believes about candidate `i`'s latency in `slice` at `now`: the
    /// posterior shifted by the fast level, and the slice's histogram.
    #[must_use]
    pub fn belief(&self, i: usize, slice: SlicePath, now: Timestamp) -> LatencyBelief {
        let effective = self.effective(i, slice, now, true);
        let fresh = self.freshness(i, now);
        let mut posterior = self.faded(effective.posterior(&self.cfg.latency_prior), fresh);
        let shift = self.levels[i].shift(now, &self.cfg, posterior.mean_sigma2());
        posterior.mu_n += shift;
        // A stale candidate's histogram fades with its posterior, so the prior regains the
        // same share of the blend.
        let mut shape = effective.shape;
        if fresh < 1.0 {
            shape.scale(fresh);
        }
        LatencyBelief {
            posterior,
            shift,
            shape,
            shape_prior_weight: self.cfg.shape_prior_weight,
        }
    }

    /// [`Self::posterior`] with the fast level's location shift: what the ranking uses.
    #[must_use]
    pub fn current(&self, i: usize, slice: SlicePath, now: Timestamp) -> NigPosterior {
        let mut post = self.faded(self.posterior(i, slice, now), self.freshness(i, now));
        post.mu_n += self.levels[i].shift(now, &self.cfg, post.mean_sigma2());
        post
    }

    /// Smoothed failure probability of candidate `i` at `now`.
    #[must_use]
    pub fn failure_rate(&self, i: usize, now: Timestamp) -> f64 {
        match self.stale_counts(i, now) {
            None => self.failures[i].rate(now, &self.cfg.failure),
            Some(counts) => self.rate_of_counts(counts),
        }
    }

    /// The failure rate of stale-decayed `(failed, succeeded)` counts with the prior.
    fn rate_of_counts(&self, (failed, succeeded): (f64, f64)) -> f64 {
        let prior = &self.cfg.failure;
        let den = failed + succeeded + prior.prior_weight;
        if den > 0.0 {
            (failed + prior.prior_rate * prior.prior_weight) / den
        } else {
            prior.prior_rate
        }
    }

    /// Point estimates (no sampling): failure rate and the posterior predictive deadline-miss
    /// probability.
    #[must_use]
    pub fn point(&self, i: usize, ctx: &RankContext<'_>) -> (f64, f64) {
        let failure = self.failure_rate(i, ctx.now);
        let exceed = ctx
            .deadline
            .map_or(0.0, |d| self.belief(i, ctx.slice, ctx.now).exceedance(d.0));
        (failure, exceed)
    }

    /// The point beliefs the hedge delay reads: latency (posterior and histogram) and
    /// failure rate of candidate `i` in the request's slice.
    #[must_use]
    pub fn outlook(&self, i: usize, ctx: &RankContext<'_>) -> crate::hedge::LatencyOutlook {
        crate::hedge::LatencyOutlook {
            latency: self.belief(i, ctx.slice, ctx.now),
            failure_rate: self.failure_rate(i, ctx.now),
        }
    }

    /// A Thompson draw of candidate `i`'s risk for this request. Draws from `rng` only when
    /// the request has a deadline and the candidate is not guarded.
    pub fn sample(&self, i: usize, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> RiskSample {
        // The stale-decayed counts once: the point rate and the draw both come from them.
        let counts = self.stale_counts(i, ctx.now);
        let point_failure = match counts {
            None => self.failures[i].rate(ctx.now, &self.cfg.failure),
            Some(c) => self.rate_of_counts(c),
        };
        let failure = counts.map_or(point_failure, |c| {
            self.draw_of_counts(c, point_failure, rng)
        });
        let belief = self.belief(i, ctx.slice, ctx.now);
        let post = belief.posterior;
        let latency_unseen = self.latency_unseen(i);
        let Some(deadline) = ctx.deadline else {
            return RiskSample {
                failure,
                exceedance: 0.0,
                bad: failure,
                guarded: point_failure > self.cfg.exploration_guard,
                median_ms: post.median_ms(),
                latency_unseen,
            };
        };
        // The histogram's part of `P(L > d)` once, for the guard's bound and the draw.
        let at = belief.at(deadline.0);
        if let Some(exceedance) = self.over_guard(point_failure, &at) {
            return RiskSample {
                failure,
                exceedance,
                bad: bad_outcome_probability(failure, exceedance),
                guarded: true,
                median_ms: post.median_ms(),
                latency_unseen,
            };
        }
        let exceedance = at.sampled(rng);
        RiskSample {
            failure,
            exceedance,
            bad: bad_outcome_probability(failure, exceedance),
            guarded: false,
            median_ms: post.median_ms(),
            latency_unseen,
        }
    }

    /// Whether no latency of candidate `i` was ever recorded (in any slice: every observation
    /// reaches the root), so that its posterior is the prior.
    #[must_use]
    pub fn latency_unseen(&self, i: usize) -> bool {
        let root = SlicePath::root().levels()[0];
        self.latency
            .get(&(i as u32, root))
            .is_none_or(|s| s.stats.count == 0)
    }

    /// The point `P(L>d)` when the point-estimate `P(bad)` exceeds the exploration guard
    /// (`None` when it does not, the point then not always computed). It does when the
    /// point `P(L>d)` exceeds `t = (guard − P(fail))/(1 − P(fail))`; a median below the
    /// deadline means the NIG part of `P(L>d)` is at most ½, which settles the common case
    /// without evaluating the t tail.
    fn over_guard(&self, failure: f64, at: &Exceedance<'_>) -> Option<f64> {
        let guard = self.cfg.exploration_guard;
        if failure >= 1.0 {
            return Some(at.point());
        }
        let threshold = (guard - failure) / (1.0 - failure);
        if at.bound().is_some_and(|bound| bound <= threshold) {
            return None;
        }
        let point = at.point();
        (bad_outcome_probability(failure, point) > guard).then_some(point)
    }

    /// How much of candidate `i`'s latency evidence still counts at `now`: `2^(−age/h)`, where
    /// `age` is the time since its last attempt and `h` is the latency part's stale half-life
    /// ([`RiskConfig::stale_latency_half_life`]; 1 when off). A
    /// candidate in use is refreshed by every call and keeps its belief; one the ranking left
    /// (after an outage, a spike or an open breaker) drifts back to the prior, so its draws
    /// widen and it is tried again within a few half-lives. No state of its own: the age is
    /// read from the failure counts' and the fast level's timestamps, so saved states load.
    #[must_use]
    pub fn freshness(&self, i: usize, now: Timestamp) -> f64 {
        decay_factor(self.cfg.stale_latency_half_life(), self.age(i, now))
    }

    /// [`Self::freshness`] of candidate `i`'s failure evidence, with the failure part's
    /// stale half-life ([`RiskConfig::stale_failure_half_life`]).
    #[must_use]
    pub fn failure_freshness(&self, i: usize, now: Timestamp) -> f64 {
        decay_factor(self.cfg.stale_failure_half_life(), self.age(i, now))
    }

    /// Discards candidate `i`'s failure evidence (its breaker saw it recover at `now`): the
    /// failure rate is the prior's again. Its attempt count and its clock stay.
    pub fn forget_failures(&mut self, i: usize, now: Timestamp) {
        if let Some(f) = self.failures.get_mut(i) {
            f.decay_to(now, &self.cfg.failure);
            f.failures = 0.0;
            f.attempts = 0.0;
        }
    }

    /// Time since candidate `i`'s last attempt, in ms.
    fn age(&self, i: usize, now: Timestamp) -> f64 {
        now.0 - self.failures[i].at.0.max(self.levels[i].at.0)
    }

    /// Candidate `i`'s (failed, succeeded) attempt counts at `now`, decayed by the failure
    /// half-life and by [`Self::failure_freshness`].
    fn stale_failure_counts(&self, i: usize, now: Timestamp) -> (f64, f64) {
        let f = &self.failures[i];
        let decay = decay_factor(self.cfg.failure.half_life_ms, now.0 - f.at.0);
        let weight = decay * self.failure_freshness(i, now);
        let failed = f.failures * weight;
        (failed, (f.attempts * weight - failed).max(0.0))
    }

    /// The failure probability of a draw for candidate `i`: the draw of its stale counts, or
    /// `point` with staleness off (what [`Self::sample`] does with the counts it holds).
    #[cfg(test)]
    fn sampled_failure(&self, i: usize, now: Timestamp, point: f64, rng: &mut dyn RngCore) -> f64 {
        self.stale_counts(i, now)
            .map_or(point, |c| self.draw_of_counts(c, point, rng))
    }

    /// Candidate `i`'s stale-decayed counts when staleness is on (`None`: off).
    fn stale_counts(&self, i: usize, now: Timestamp) -> Option<(f64, f64)> {
        self.cfg
            .stale_failure_half_life()
            .map(|_| self.stale_failure_counts(i, now))
    }

    /// The failure probability used in a draw (staleness on): a draw from the Beta posterior
    /// of the stale-decayed counts and the prior (mean `point`), so that a candidate with few
    /// recent attempts has a wide draw.
    fn draw_of_counts(
        &self,
        (failed, succeeded): (f64, f64),
        point: f64,
        rng: &mut dyn RngCore,
    ) -> f64 {
        let prior = &self.cfg.failure;
        let a = failed + prior.prior_rate * prior.prior_weight;
        let b = succeeded + (1.0 - prior.prior_rate) * prior.prior_weight;
        beta_draw(a, b, rng).unwrap_or(point)
    }

    /// `post` with its data weighted by `fresh` (a [`Self::freshness`]): the data's
    /// pseudo-count, its share of the mean and its spread shrink by the same factor, so a
    /// stale posterior moves back toward the prior (exactly the posterior of the data with
    /// every weight scaled).
    fn faded(&self, post: NigPosterior, fresh: f64) -> NigPosterior {
        if fresh >= 1.0 {
            return post;
        }
        shrink_toward_prior(&post, &self.cfg.latency_prior, fresh)
    }

    /// Learns from one attempt: provider failures and successes feed the failure EWMA
    /// (client errors and cancellations do not); completed latencies feed every slice level;
    /// timeouts and cancellations are censored and imputed (see [`LogLatencyStats`]).
    ///
    /// A rest ([`crate::decision::AttemptOutcome::is_rest`]: an unbilled 429 with
    /// `Retry-After`) is not a failure: the breaker keeps the provider out until then and a
    /// fallback answers. A rest right after a rest is one: the provider refused again once
    /// the time it gave was up, so its `Retry-After` does not describe its capacity (a
    /// provider limiting most calls whatever the rate) and the policy must see it fail.
    pub fn observe(&mut self, obs: &AttemptObservation<'_>) {
        let i = obs.candidate;
        let status = obs.outcome.status;
        if !matches!(
            status,
            AttemptStatus::ClientError | AttemptStatus::Cancelled
        ) {
            let rest = obs.outcome.is_rest();
            let after_rest = self.rested.get_mut(i).map(|r| std::mem::replace(r, rest));
            if rest && after_rest == Some(false) {
                return;
            }
        }
        match status {
            AttemptStatus::ClientError => return,
            AttemptStatus::Cancelled => {}
            AttemptStatus::Ok | AttemptStatus::Timeout | AttemptStatus::ProviderError(_) => {
                self.failures[i].record(obs.now, status.is_provider_failure(), &self.cfg.failure);
            }
        }
        let hl = self.cfg.latency_half_life_ms;
        let latency = obs.outcome.latency.0;
        let tracks_level = self.cfg.level_beta > 0.0;
        let unclassed = !obs.slice.has_task_class();
        if status.is_censored() {
            let post = self.posterior(i, obs.slice, obs.now);
            let (mean, var) = post.censored_moments(latency);
            if tracks_level && status == AttemptStatus::Timeout {
                // A cut-off says the call took at least this long: its imputed log-latency
                // (never below the cut-off's) moves the level.
                self.levels[i].observe(obs.now, mean - post.mu_n, &self.cfg);
            }
            let point = post.point();
            let shares = self.censored_shares(i, obs, point);
            for &key in obs.slice.levels().iter().take(self.cfg.slice_depth) {
                let stats = self.slice_mut(i, key, unclassed);
                stats.observe_imputed(obs.now, mean, var, hl);
                match &shares {
                    Some(shares) => stats.observe_tail_shares(obs.now, shares, hl),
                    None => stats.observe_tail_shape(obs.now, latency, point, hl),
                }
            }
        } else if status == AttemptStatus::Ok {
            if tracks_level {
                let mu = self.posterior(i, obs.slice, obs.now).mu_n;
                self.levels[i].observe(obs.now, latency.max(1e-3).ln() - mu, &self.cfg);
            }
            for &key in obs.slice.levels().iter().take(self.cfg.slice_depth) {
                self.slice_mut(i, key, unclassed)
                    .observe(obs.now, latency, hl);
            }
        }
        self.keep_within_bytes();
    }

    /// With [`CensoredTail::Belief`], how a censored attempt of candidate `i` spreads over the
    /// histogram: by the slice's blended belief above the cut-off (`None`: by the log-normal
    /// point estimate `point`, the default).
    fn censored_shares(
        &self,
        i: usize,
        obs: &AttemptObservation<'_>,
        (mu, sigma): (f64, f64),
    ) -> Option<[f64; crate::estimators::shape::BINS]> {
        let n0 = self.cfg.shape_prior_weight?;
        if self.cfg.censored_tail != CensoredTail::Belief {
            return None;
        }
        let effective = self.effective(i, obs.slice, obs.now, true);
        let cut = obs.outcome.latency.0.max(1e-3).ln();
        effective.shape.tail_shares(cut, mu, sigma, n0)
    }

    /// Exports the statistics, slices sorted by (candidate, key).
    #[must_use]
    pub fn export(&self) -> RiskState {
        let mut slices: Vec<SliceStats> = self
            .latency
            .iter()
            .map(|(&(candidate, slice), s)| SliceStats {
                candidate,
                slice,
                stats: s.stats,
                unclassed: s.unclassed,
            })
            .collect();
        slices.sort_by_key(|s| (s.candidate, s.slice));
        RiskState {
            failures: self.failures.clone(),
            levels: self.levels.clone(),
            slices,
        }
    }

    /// Adds another instance's statistics.
    ///
    /// # Errors
    /// Different candidate counts.
    pub fn merge(&mut self, other: &RiskState) -> Result<(), StateError> {
        check_len("candidates", self.failures.len(), other.failures.len())?;
        if let Some(bad) = other
            .slices
            .iter()
            .find(|s| s.candidate as usize >= self.failures.len())
        {
            return Err(StateError::Shape {
                what: format!("slice statistics for candidate {}", bad.candidate),
            });
        }
        if !other.levels.is_empty() {
            check_len("candidates", self.levels.len(), other.levels.len())?;
        }
        for (f, o) in self.failures.iter_mut().zip(&other.failures) {
            f.merge(o, &self.cfg.failure);
        }
        // The level is an EMA, not a sum: the instance with the newer call wins.
        for (l, o) in self.levels.iter_mut().zip(&other.levels) {
            if o.at.0 > l.at.0 {
                *l = *o;
            }
        }
        for s in &other.slices {
            let slice = self.latency.entry((s.candidate, s.slice)).or_default();
            slice.stats.merge(&s.stats, self.cfg.latency_half_life_ms);
            slice.unclassed |= s.unclassed;
        }
        // Another instance's (or a state file's) slices count against the same bounds.
        self.evict_to(self.cfg.max_slices);
        self.keep_within_bytes();
        Ok(())
    }
}

/// A draw from `Beta(a, b)` (via two Gamma draws); `None` when a parameter is not positive.
/// A zero `a` (no failure and a zero prior rate) is the point mass at 0.
fn beta_draw(a: f64, b: f64, rng: &mut dyn RngCore) -> Option<f64> {
    if a <= 0.0 {
        return (b > 0.0).then_some(0.0);
    }
    if b <= 0.0 {
        return Some(1.0);
    }
    let x = rand_distr::Gamma::new(a, 1.0).ok()?.sample(rng);
    let y = rand_distr::Gamma::new(b, 1.0).ok()?.sample(rng);
    (x + y > 0.0).then(|| x / (x + y))
}

/// The NIG posterior of the same data with every weight multiplied by `fresh` (0–1).
fn shrink_toward_prior(post: &NigPosterior, prior: &NigPrior, fresh: f64) -> NigPosterior {
    let n = post.kappa_n - prior.kappa0;
    if n <= 0.0 {
        return *post;
    }
    let mean = (post.kappa_n * post.mu_n - prior.kappa0 * prior.mu0) / n;
    let gap = (mean - prior.mu0).powi(2);
    let half_deviations =
        (post.beta_n - prior.beta0 - prior.kappa0 * n * gap / (2.0 * post.kappa_n)).max(0.0);
    let kept = n * fresh;
    let kappa = prior.kappa0 + kept;
    NigPosterior {
        mu_n: (prior.kappa0 * prior.mu0 + kept * mean) / kappa,
        kappa_n: kappa,
        alpha_n: prior.alpha0 + (post.alpha_n - prior.alpha0) * fresh,
        beta_n: prior.beta0 + half_deviations * fresh + prior.kappa0 * kept * gap / (2.0 * kappa),
    }
}

/// `C_ref` for a request: configured, or the mean expected cost of the eligible candidates.
pub(crate) fn cost_reference(configured: Option<f64>, ctx: &RankContext<'_>) -> f64 {
    configured.unwrap_or_else(|| {
        if ctx.eligible.is_empty() {
            0.0
        } else {
            ctx.eligible
                .iter()
                .map(|&i| ctx.expected_cost(i))
                .sum::<f64>()
                / ctx.eligible.len() as f64
        }
    })
}

/// `1 / (1 + cost/C_ref)`, 1 when there is no cost reference.
pub(crate) fn cost_factor(cost: f64, cost_ref: f64) -> f64 {
    if cost_ref > 0.0 {
        1.0 / (1.0 + cost / cost_ref)
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{AttemptOutcome, Millis};
    use rand::SeedableRng;

    fn ok(model: &mut RiskModel, latency_ms: f64, now_ms: f64) {
        model.observe(&AttemptObservation {
            candidate: 0,
            features: &[],
            slice: SlicePath::root(),
            deadline: None,
            outcome: &AttemptOutcome::ok(latency_ms),
            now: Timestamp(now_ms),
        });
    }

    fn exceedance(post: &NigPosterior) -> f64 {
        post.predictive_exceedance(1000.0)
    }

    /// 500 calls at 250–350 ms, one every 100 ms, then five at 1.5 s (load).
    fn loaded(level_beta: f64) -> RiskModel {
        let mut m = RiskModel::new(
            1,
            RiskConfig {
                level_beta,
                ..RiskConfig::default()
            },
        );
        for t in 0..500 {
            ok(
                &mut m,
                if t % 2 == 0 { 250.0 } else { 350.0 },
                f64::from(t) * 100.0,
            );
        }
        for t in 500..505 {
            ok(&mut m, 1500.0, f64::from(t) * 100.0);
        }
        m
    }

    #[test]
    fn a_rest_is_not_a_failure_but_a_rest_right_after_a_rest_is() {
        use crate::decision::ProviderFailure;
        let observe = |m: &mut RiskModel, outcome: AttemptOutcome, now_ms: f64| {
            m.observe(&AttemptObservation {
                candidate: 0,
                features: &[],
                slice: SlicePath::root(),
                deadline: None,
                outcome: &outcome,
                now: Timestamp(now_ms),
            });
        };
        let limited = |retry_after: Option<f64>| AttemptOutcome {
            retry_after: retry_after.map(Millis),
            ..AttemptOutcome::with_status(
                40.0,
                AttemptStatus::ProviderError(ProviderFailure::RateLimited),
            )
        };
        let mut m = RiskModel::new(1, RiskConfig::default());
        let mut t = 0.0;
        // A provider at its capacity: an answer, then a 429 saying when the next call fits.
        for _ in 0..20 {
            ok(&mut m, 300.0, t);
            observe(&mut m, limited(Some(500.0)), t + 100.0);
            t += 1000.0;
        }
        let rested = m.failure_rate(0, Timestamp(t));
        assert!(rested < 0.05, "20 answers and 20 rests: {rested}");
        // The same 429s without Retry-After are failures: about half the calls.
        let mut plain = RiskModel::new(1, RiskConfig::default());
        let mut t2 = 0.0;
        for _ in 0..20 {
            ok(&mut plain, 300.0, t2);
            observe(&mut plain, limited(None), t2 + 100.0);
            t2 += 1000.0;
        }
        let failing = plain.failure_rate(0, Timestamp(t2));
        assert!(failing > 0.4, "20 answers and 20 plain 429s: {failing}");
        // Refused again once its Retry-After is up: its capacity is not what it says, and
        // every refusal after the first of a run counts.
        for _ in 0..20 {
            observe(&mut m, limited(Some(500.0)), t);
            t += 600.0;
        }
        let refusing = m.failure_rate(0, Timestamp(t));
        assert!(
            refusing > 0.4,
            "20 refusals in a row after answers: {refusing}"
        );
    }

    #[test]
    fn the_level_follows_load_within_a_few_calls_and_fades_without_calls() {
        let now = Timestamp(50_400.0);
        let m = loaded(0.3);
        let slow = m.posterior(0, SlicePath::root(), now);
        let current = m.current(0, SlicePath::root(), now);
        // Five calls among 505 barely move the 10-minute posterior; the level does:
        // residual ≈ (1 − 0.7⁵)·ln(1500/~300) ≈ 0.83·1.6.
        assert!(
            exceedance(&slow) < 0.05,
            "slow posterior {}",
            exceedance(&slow)
        );
        assert!(
            exceedance(&current) > 0.5,
            "with the level {}",
            exceedance(&current)
        );
        // Trust halves every 30 s without a call.
        let shift = m.levels[0].shift(now, &m.cfg, 0.1);
        let later = m.levels[0].shift(Timestamp(now.0 + 30_000.0), &m.cfg, 0.1);
        assert!(shift > 1.0, "{shift}");
        assert!((later / shift - 0.5).abs() < 1e-9, "{later} vs {shift}");
        // Off (the reference design): the ranking sees the posterior as it is.
        let off = loaded(0.0);
        assert_eq!(
            off.current(0, SlicePath::root(), now),
            off.posterior(0, SlicePath::root(), now)
        );
        assert_eq!(off.levels[0], Level::default());
    }

    #[test]
    #[allow(clippy::float_cmp)] // a zero from max(0, ·) and an untouched residual: exact
    fn the_level_moves_the_location_only_past_its_noise() {
        let cfg = RiskConfig {
            level_beta: 0.3,
            level_z: 2.0,
            ..RiskConfig::default()
        };
        let now = Timestamp(1_000.0);
        let level = |residual: f64| Level { residual, at: now };
        // A wide provider (σ = 0.6): the EMA's noise is 0.6·sqrt(0.3/1.7) ≈ 0.252, the gate
        // 2 of them; a residual within it does not move the location, one beyond it moves
        // it by the excess, with its sign.
        let gate = 2.0 * (0.36f64 * 0.3 / 1.7).sqrt();
        assert_eq!(level(0.45).shift(now, &cfg, 0.36), 0.0);
        assert_eq!(level(-0.45).shift(now, &cfg, 0.36), 0.0);
        assert!((level(1.2).shift(now, &cfg, 0.36) - (1.2 - gate)).abs() < 1e-12);
        assert!((level(-1.2).shift(now, &cfg, 0.36) + (1.2 - gate)).abs() < 1e-12);
        // A tight provider (σ = 0.1) shifts by nearly all of the same residual.
        assert!(level(0.45).shift(now, &cfg, 0.01) > 0.35);
        // z = 0 is the level as it is.
        let plain = RiskConfig {
            level_z: 0.0,
            ..cfg
        };
        assert_eq!(level(0.45).shift(now, &plain, 0.36), 0.45);
        // Through the model: the loaded provider's five slow calls (five times its usual
        // latency) still move the ranking's location past the gate.
        let mut m = loaded(0.3);
        m.cfg.level_z = 2.0;
        let t = Timestamp(50_400.0);
        let slow = m.posterior(0, SlicePath::root(), t);
        let current = m.current(0, SlicePath::root(), t);
        assert!(
            current.mu_n - slow.mu_n > 0.5,
            "{} vs {}",
            current.mu_n,
            slow.mu_n
        );
        let bad = RiskConfig {
            level_z: -1.0,
            ..cfg
        };
        assert!(bad.validate().unwrap_err().to_string().contains("level_z"));
    }

    #[test]
    fn a_timeout_raises_the_level_to_at_least_its_cut_off() {
        let mut m = RiskModel::new(
            1,
            RiskConfig {
                level_beta: 1.0,
                ..RiskConfig::default()
            },
        );
        for t in 0..100 {
            ok(&mut m, 300.0, f64::from(t) * 100.0);
        }
        let mu = m.posterior(0, SlicePath::root(), Timestamp(10_000.0)).mu_n;
        m.observe(&AttemptObservation {
            candidate: 0,
            features: &[],
            slice: SlicePath::root(),
            deadline: Some(Millis(3000.0)),
            outcome: &AttemptOutcome::with_status(3000.0, AttemptStatus::Timeout),
            now: Timestamp(10_000.0),
        });
        // β = 1: the level is this one call's imputed log-latency, at least ln 3000 − μ.
        assert!(
            m.levels[0].residual >= 3000f64.ln() - mu - 1e-9,
            "{} vs {}",
            m.levels[0].residual,
            3000f64.ln() - mu
        );
    }

    #[test]
    fn levels_merge_newest_first_and_check_their_length() {
        let a = loaded(0.3);
        let mut b = RiskModel::new(1, a.cfg);
        ok(&mut b, 300.0, 1.0);
        let newer = a.export();
        b.merge(&newer).unwrap();
        assert_eq!(b.levels[0], a.levels[0], "the later call's level wins");
        let mut c = loaded(0.3);
        let before = c.levels[0];
        let mut old = RiskModel::new(1, a.cfg);
        ok(&mut old, 300.0, 1.0);
        c.merge(&old.export()).unwrap();
        assert_eq!(
            c.levels[0], before,
            "an older level does not replace a newer one"
        );
        // A state exported before levels existed merges; a wrong length does not.
        let mut legacy = newer.clone();
        legacy.levels.clear();
        c.merge(&legacy).unwrap();
        let mut wrong = newer;
        wrong.levels.push(Level::default());
        assert!(c.merge(&wrong).is_err());
    }

    #[test]
    fn point_estimates_and_guarded_candidates_use_the_posterior_predictive() {
        // The seven latencies of the nig test: plug-in P(L > 5 medians) 0.0053, predictive 0.0110.
        let mut m = RiskModel::new(
            1,
            RiskConfig {
                latency_half_life_ms: None,
                exploration_guard: 0.0,
                shape_prior_weight: None,
                ..RiskConfig::default()
            },
        );
        for (t, d) in [-0.9, -0.6, -0.34, 0.0, 0.34, 0.6, 0.9]
            .into_iter()
            .enumerate()
        {
            ok(&mut m, 1000.0 * f64::exp(d), t as f64);
        }
        let candidates = [crate::Candidate::new("a", "a", "a")];
        let mut ctx = RankContext::new(&candidates, &[0], &[]);
        ctx.deadline = Some(Millis(5000.0));
        ctx.now = Timestamp(7.0);
        let (_, exceed) = m.point(0, &ctx);
        assert!((exceed - 0.0110).abs() < 5e-5, "{exceed}");
        // A guard of 0 holds the candidate back; its P(bad) is the predictive, not a draw.
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(1);
        let r = m.sample(0, &ctx, &mut rng);
        assert!(r.guarded);
        assert!((r.exceedance - exceed).abs() < 1e-15, "{}", r.exceedance);
    }

    #[test]
    fn histograms_merge_exactly_and_old_states_load_without_them() {
        // Two instances' histograms add up to the histogram of one that saw every call.
        let cfg = RiskConfig::default();
        let (mut a, mut b, mut all) = (
            RiskModel::new(1, cfg),
            RiskModel::new(1, cfg),
            RiskModel::new(1, cfg),
        );
        for t in 0..200 {
            let latency = if t % 3 == 0 { 2500.0 } else { 80.0 };
            let now = f64::from(t) * 50.0;
            ok(if t % 2 == 0 { &mut a } else { &mut b }, latency, now);
            ok(&mut all, latency, now);
        }
        let mut merged = RiskModel::new(1, cfg);
        merged.merge(&a.export()).unwrap();
        merged.merge(&b.export()).unwrap();
        let (m, w) = (
            merged.latency[&(0, ROOT)].stats,
            all.latency[&(0, ROOT)].stats,
        );
        for (x, y) in m.shape.mass.iter().zip(&w.shape.mass) {
            assert!((x - y).abs() < 1e-9, "{x} vs {y}");
        }
        assert!((m.shape.total() - m.weight).abs() < 1e-9);
        // A state saved before histograms: no `shape` field; it loads with an empty one and
        // the belief is the log-normal until calls arrive.
        let mut json = serde_json::to_value(all.export()).unwrap();
        json["slices"][0]["stats"]
            .as_object_mut()
            .unwrap()
            .remove("shape");
        let old: RiskState = serde_json::from_value(json).unwrap();
        assert!(old.slices[0].stats.shape.is_empty());
        let mut restored = RiskModel::new(1, cfg);
        restored.merge(&old).unwrap();
        let now = Timestamp(10_000.0);
        let belief = restored.belief(0, SlicePath::root(), now);
        assert!(
            (belief.exceedance(1500.0) - belief.posterior.predictive_exceedance(1500.0)).abs()
                < 1e-15
        );
        // With the histogram, P(L > 1500 ms) is near the true third; the log-normal is not.
        let p = all.belief(0, SlicePath::root(), now).exceedance(1500.0);
        assert!((p - 1.0 / 3.0).abs() < 0.03, "{p}");
    }

    fn in_task(model: &mut RiskModel, candidate: usize, task: &str, latency_ms: f64, now_ms: f64) {
        let slice = SlicePath::from_parts(Some(task), Some("<5s"), false, Some(0), 4);
        model.observe(&AttemptObservation {
            candidate,
            features: &[],
            slice,
            deadline: None,
            outcome: &AttemptOutcome::ok(latency_ms),
            now: Timestamp(now_ms),
        });
    }

    #[test]
    fn a_hundred_thousand_task_classes_stay_under_the_slice_cap() {
        let cap = 1000;
        let mut m = RiskModel::new(
            2,
            RiskConfig {
                max_slices: cap,
                ..RiskConfig::default()
            },
        );
        // A task class used all along, then one new class per request (a client steering
        // memory), both candidates.
        let mut evicted = 0;
        for t in 0..100_000u32 {
            let now = f64::from(t) * 10.0;
            if t % 10 == 0 {
                in_task(&mut m, 0, "summarise", 300.0, now);
            }
            in_task(&mut m, (t % 2) as usize, &format!("class-{t}"), 300.0, now);
            assert!(m.slice_count() <= cap, "{} slices at {t}", m.slice_count());
            evicted += m.take_evictions();
        }
        // Three levels per new class: all but the last cap-or-so were evicted.
        assert!(evicted >= 300_000 - cap as u64, "{evicted}");
        let state = m.export();
        assert!(state.slices.len() <= cap + 2, "{}", state.slices.len());
        // The roots and the class in steady use survive the flood.
        let summarise = SlicePath::from_parts(Some("summarise"), Some("<5s"), false, Some(0), 4);
        for &key in summarise.levels() {
            assert!(
                state
                    .slices
                    .iter()
                    .any(|s| s.candidate == 0 && s.slice == key),
                "slice {key:x} of the busy class was evicted"
            );
        }
        assert!(state
            .slices
            .iter()
            .any(|s| s.candidate == 1 && s.slice == ROOT));
    }

    #[test]
    fn merged_slices_count_against_the_cap_and_drop_the_least_observed() {
        let cfg = RiskConfig {
            max_slices: 6,
            latency_half_life_ms: None,
            ..RiskConfig::default()
        };
        let mut busy = RiskModel::new(1, cfg);
        for t in 0..50 {
            in_task(&mut busy, 0, "code", 300.0, f64::from(t));
        }
        let mut flood = RiskModel::new(
            1,
            RiskConfig {
                max_slices: 100,
                ..cfg
            },
        );
        for t in 0..20 {
            in_task(&mut flood, 0, &format!("x{t}"), 300.0, 100.0 + f64::from(t));
        }
        assert_eq!(flood.slice_count(), 60);
        busy.merge(&flood.export()).unwrap();
        assert_eq!(busy.slice_count(), 6);
        assert_eq!(busy.take_evictions(), 57);
        // Dropped, not folded: the root holds every observation once (50 + 20).
        let root = busy.latency[&(0, ROOT)].stats;
        assert!((root.weight - 70.0).abs() < 1e-9, "{}", root.weight);
        // The three slices of `code` (50 observations each) are the most useful.
        let code = SlicePath::from_parts(Some("code"), Some("<5s"), false, Some(0), 4);
        for &key in &code.levels()[1..] {
            assert!(busy.latency.contains_key(&(0, key)));
        }
    }

    /// One call of `latency_ms` on `slice`.
    fn on_path(model: &mut RiskModel, candidate: usize, slice: SlicePath, now_ms: f64) {
        model.observe(&AttemptObservation {
            candidate,
            features: &[],
            slice,
            deadline: None,
            outcome: &AttemptOutcome::ok(300.0),
            now: Timestamp(now_ms),
        });
    }

    #[test]
    fn the_slice_table_stays_within_its_byte_budget_and_evicts_the_least_used() {
        let budget = 256 << 10;
        let mut m = RiskModel::new(
            2,
            RiskConfig {
                max_slice_bytes: budget,
                // The count does not bind: the bytes do.
                max_slices: 1_000_000,
                ..RiskConfig::default()
            },
        );
        // 160 + 1 bytes of key and statistics, at most 7/8 of the table's buckets used.
        assert_eq!(RiskModel::SLICE_ENTRY_BYTES, 376);
        let mut evicted = 0;
        for t in 0..30_000u32 {
            let now = f64::from(t) * 10.0;
            if t % 10 == 0 {
                in_task(&mut m, 0, "summarise", 300.0, now);
            }
            in_task(&mut m, (t % 2) as usize, &format!("class-{t}"), 300.0, now);
            assert!(
                m.slice_bytes() <= budget,
                "{} bytes at {t}",
                m.slice_bytes()
            );
            evicted += m.take_evictions();
        }
        // 256 KiB hold a table of 448 entries (512 buckets of 329 bytes: 168 KiB; the next
        // size, 336 KiB, does not fit): the two roots and, after each eviction of an eighth,
        // 392 to 446 slices.
        let kept = m.slice_count();
        assert!((390..=446).contains(&kept), "{kept} slices kept");
        assert!(evicted >= 90_000 - 446, "{evicted}");
        // What a snapshot carries is what the table holds.
        let state = m.export();
        assert_eq!(state.slices.len(), kept + 2);
        assert!(state.slices.len() * RiskModel::SLICE_ENTRY_BYTES <= budget);
        // The class in steady use is the most used, not the oldest: it stays.
        let summarise = SlicePath::from_parts(Some("summarise"), Some("<5s"), false, Some(0), 4);
        for &key in summarise.levels() {
            assert!(
                m.latency.contains_key(&(0, key)),
                "slice {key:x} of the busy class was evicted"
            );
        }
    }

    #[test]
    fn a_flood_of_classes_leaves_an_unclassed_requests_statistics_untouched() {
        let mut m = RiskModel::new(
            2,
            RiskConfig {
                max_slices: 100,
                ..RiskConfig::default()
            },
        );
        let unclassed = SlicePath::from_parts(None, Some("<5s"), false, Some(0), 4);
        assert!(!unclassed.has_task_class());
        for t in 0..20 {
            on_path(&mut m, 0, unclassed, f64::from(t));
        }
        let of_path = |m: &RiskModel| -> Vec<SliceStats> {
            m.export()
                .slices
                .into_iter()
                .filter(|s| s.candidate == 0 && unclassed.levels()[1..].contains(&s.slice))
                .collect()
        };
        let before = of_path(&m);
        assert_eq!(before.len(), 3);
        // An hour later (six half-lives: the 20 calls weigh 0.3 now), a new class per call,
        // both candidates: each new slice weighs more than the unclassed ones.
        for t in 0..5_000u32 {
            let class =
                SlicePath::from_parts(Some(&format!("class-{t}")), Some("<5s"), false, Some(0), 4);
            assert!(class.has_task_class());
            on_path(&mut m, (t % 2) as usize, class, 3_600_000.0 + f64::from(t));
        }
        assert!(m.take_evictions() > 14_000);
        // The unclassed path's statistics are exactly as they were.
        assert_eq!(of_path(&m), before);
    }

    #[test]
    fn a_merged_state_larger_than_the_budget_is_cut_to_it_and_gives_the_memory_back() {
        // An instance (or a state file) without the byte bound: 20,000 classes, 60,000 slices.
        let mut big = RiskModel::new(
            1,
            RiskConfig {
                max_slices: 1_000_000,
                max_slice_bytes: 1 << 30,
                ..RiskConfig::default()
            },
        );
        for t in 0..20_000u32 {
            in_task(&mut big, 0, &format!("class-{t}"), 300.0, f64::from(t));
        }
        assert!(big.slice_bytes() > 20 << 20, "{}", big.slice_bytes());
        let mut m = RiskModel::new(1, RiskConfig::default());
        m.merge(&big.export()).unwrap();
        assert!(m.slice_bytes() <= RiskConfig::DEFAULT_MAX_SLICE_BYTES);
        // 2 MiB: a table of 3,584 entries, the root and at least 7/8 of the rest kept.
        assert!(
            (3_100..3_584).contains(&m.slice_count()),
            "{}",
            m.slice_count()
        );
        // The newest classes are the ones kept.
        let newest = SlicePath::from_parts(Some("class-19999"), Some("<5s"), false, Some(0), 4);
        assert!(m.latency.contains_key(&(0, newest.levels()[3])));
    }

    fn attempt(model: &mut RiskModel, status: AttemptStatus, now_ms: f64) {
        model.observe(&AttemptObservation {
            candidate: 0,
            features: &[],
            slice: SlicePath::root(),
            deadline: None,
            outcome: &AttemptOutcome::with_status(20.0, status),
            now: Timestamp(now_ms),
        });
    }

    /// 400 calls, one every 250 ms: healthy for 50 s, then 50 s of outage (connection
    /// failures); nothing after t = 100 s.
    fn after_outage(stale_half_life_ms: Option<f64>) -> RiskModel {
        let mut m = RiskModel::new(
            1,
            RiskConfig {
                stale_half_life_ms,
                ..RiskConfig::default()
            },
        );
        for t in 0..400 {
            let status = if t < 200 {
                AttemptStatus::Ok
            } else {
                AttemptStatus::ProviderError(crate::decision::ProviderFailure::Connection)
            };
            attempt(&mut m, status, f64::from(t) * 250.0);
        }
        m
    }

    #[test]
    fn an_untried_candidates_failure_belief_fades_to_the_prior_and_its_draw_widens() {
        let end = 99_750.0;
        let off = after_outage(None);
        let on = after_outage(Some(10_000.0));
        // At the end of the outage both see it failing: about 94 decayed failures against 20
        // decayed successes (from before the outage) and 2 prior pseudo-attempts, 0.81.
        assert!(off.failure_rate(0, Timestamp(end)) > 0.75);
        assert!(
            (on.failure_rate(0, Timestamp(end)) - off.failure_rate(0, Timestamp(end))).abs()
                < 1e-12
        );
        // 60 s later without an attempt. Off: 2^-3 of both counts, 11.8 failures in 14.3
        // attempts against 2 prior pseudo-attempts, still 0.72. On: the evidence also halves
        // every 10 s (2^-6 more), leaving 0.18 failures in 0.22 attempts: 0.18/2.22 ≈ 0.08.
        let later = Timestamp(end + 60_000.0);
        let stale_off = off.failure_rate(0, later);
        let stale_on = on.failure_rate(0, later);
        assert!(stale_off > 0.65, "{stale_off}");
        assert!(stale_on < 0.15, "{stale_on}");
        // Its draws are spread around that mean: a share of them reach below 2%, which is
        // what lets a healthy fallback's 0 be challenged.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let draws: Vec<f64> = (0..4000)
            .map(|_| on.sampled_failure(0, later, stale_on, &mut rng))
            .collect();
        let low = draws.iter().filter(|&&d| d < 0.02).count() as f64 / 4000.0;
        let mean = draws.iter().sum::<f64>() / 4000.0;
        // (0.58 with this seed.)
        assert!(low > 0.4, "share of draws below 2%: {low}");
        assert!(
            (mean - stale_on).abs() < 0.02,
            "draw mean {mean} vs {stale_on}"
        );
        // Off, the draw is the point estimate.
        assert!((off.sampled_failure(0, later, stale_off, &mut rng) - stale_off).abs() < 1e-15);
    }

    #[test]
    fn a_candidate_in_use_keeps_its_belief() {
        let on = after_outage(Some(10_000.0));
        let off = after_outage(None);
        let now = Timestamp(99_750.0);
        // Attempted at `now`: fully fresh, same rate and posterior as without staleness.
        assert!((on.freshness(0, now) - 1.0).abs() < 1e-15);
        assert_eq!(
            on.current(0, SlicePath::root(), now),
            off.current(0, SlicePath::root(), now)
        );
        // A healthy candidate's draw is the point mass at 0 (no failures, prior rate 0).
        let mut healthy = RiskModel::new(1, RiskConfig::default());
        for t in 0..100 {
            attempt(&mut healthy, AttemptStatus::Ok, f64::from(t) * 250.0);
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let t = Timestamp(30_000.0);
        assert!(healthy.sampled_failure(0, t, healthy.failure_rate(0, t), &mut rng) == 0.0);
    }

    #[test]
    fn a_stale_posterior_is_the_posterior_of_the_data_weighted_by_freshness() {
        let prior = NigPrior::default();
        let data = LogLatencyStats::from_latencies(&[300.0, 450.0, 280.0, 900.0, 350.0, 610.0]);
        for fresh in [1.0, 0.5, 0.1, 0.0] {
            let mut scaled = data;
            scaled.scale(fresh);
            let want = scaled.posterior(&prior);
            let got = shrink_toward_prior(&data.posterior(&prior), &prior, fresh);
            for (a, b) in [
                (got.mu_n, want.mu_n),
                (got.kappa_n, want.kappa_n),
                (got.alpha_n, want.alpha_n),
                (got.beta_n, want.beta_n),
            ] {
                assert!((a - b).abs() < 1e-9, "fresh {fresh}: {got:?} vs {want:?}");
            }
        }
        // Fully stale is the prior itself.
        assert!(
            (shrink_toward_prior(&data.posterior(&prior), &prior, 0.0).mu_n - prior.mu0).abs()
                < 1e-12
        );
    }

    #[test]
    fn the_stale_half_life_is_optional_and_defaults_when_absent() {
        let absent: RiskConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(
            absent.stale_half_life_ms,
            Some(RiskConfig::DEFAULT_STALE_HALF_LIFE_MS)
        );
        let off: RiskConfig = serde_json::from_str(r#"{"stale_half_life_ms": null}"#).unwrap();
        assert_eq!(off.stale_half_life_ms, None);
        let zero = RiskConfig {
            stale_half_life_ms: Some(0.0),
            ..RiskConfig::default()
        };
        let e = zero.validate().unwrap_err().to_string();
        assert!(e.contains("stale_half_life_ms"), "{e}");
    }

    #[test]
    fn the_latency_and_failure_parts_fade_with_their_own_half_lives() {
        // Absent, both parts use stale_half_life_ms.
        let both: RiskConfig = serde_json::from_str(r#"{"stale_half_life_ms": 10000}"#).unwrap();
        assert_eq!(both.stale_latency_half_life(), Some(10_000.0));
        assert_eq!(both.stale_failure_half_life(), Some(10_000.0));
        let split: RiskConfig = serde_json::from_str(
            r#"{"stale_latency_half_life_ms": 20000, "stale_failure_half_life_ms": 5000}"#,
        )
        .unwrap();
        assert_eq!(
            split.stale_half_life_ms,
            Some(RiskConfig::DEFAULT_STALE_HALF_LIFE_MS)
        );
        let mut m = after_outage(None);
        m.cfg = split;
        // 60 s after the last attempt: the latency evidence counts 2^-3 (20 s half-life),
        // the failure evidence 2^-12 (5 s).
        let later = Timestamp(99_750.0 + 60_000.0);
        assert!((m.freshness(0, later) - 0.125).abs() < 1e-12);
        assert!((m.failure_freshness(0, later) - 2f64.powi(-12)).abs() < 1e-15);
        // The failure counts fade by 2^-12 on top of the failure half-life.
        let (failed, succeeded) = m.stale_failure_counts(0, later);
        let off = after_outage(None);
        let f = &off.failures[0];
        let weight = decay_factor(off.cfg.failure.half_life_ms, 60_000.0) * 2f64.powi(-12);
        assert!((failed + succeeded - f.attempts * weight).abs() < 1e-9);
        // Only the failure part on: the latency posterior is the one without staleness.
        let mut failure_only = after_outage(None);
        failure_only.cfg.stale_failure_half_life_ms = Some(5_000.0);
        assert_eq!(
            failure_only.current(0, SlicePath::root(), later),
            off.current(0, SlicePath::root(), later)
        );
        assert!(failure_only.failure_rate(0, later) < off.failure_rate(0, later));
        for field in ["stale_latency_half_life_ms", "stale_failure_half_life_ms"] {
            let bad: RiskConfig = serde_json::from_str(&format!(r#"{{"{field}": -1}}"#)).unwrap();
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    #[test]
    fn level_settings_out_of_range_name_the_field() {
        for (cfg, field) in [
            (
                RiskConfig {
                    level_beta: 1.5,
                    ..RiskConfig::default()
                },
                "level_beta",
            ),
            (
                RiskConfig {
                    level_half_life_ms: 0.0,
                    ..RiskConfig::default()
                },
                "level_half_life_ms",
            ),
            (
                RiskConfig {
                    max_slices: 0,
                    ..RiskConfig::default()
                },
                "max_slices",
            ),
            (
                RiskConfig {
                    max_slice_bytes: 4096,
                    ..RiskConfig::default()
                },
                "max_slice_bytes",
            ),
        ] {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }
}
