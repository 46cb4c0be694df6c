//! Off-policy evaluation: what a *target* policy would have scored on traffic that another
//! (the *logging*) policy served, from the log alone.
//!
//! Each [`LoggedDecision`] is one request: its features, the eligible set, the candidate the
//! logging policy put first (`action`) with the probability it had of doing so
//! (`propensity`), the target policy's first-choice probabilities on the same context, and
//! the metric observed (`outcome`). With `w = target[action] / propensity`:
//!
//! ```text
//! IPS   = (1/n) Σ w·y
//! SNIPS = Σ w·y / Σ w
//! DR    = (1/n) Σ [ Σ_c target[c]·q̂(x,c) + w·(y − q̂(x,action)) ]
//! ```
//!
//! `q̂` is a ridge regression per candidate on the features (plus an intercept), fitted on the
//! same log with K-fold cross-fitting: a record's `q̂` never saw that record nor its
//! neighbours in time. Intervals are percentile **circular block bootstrap** intervals over
//! records in time order (blocks of `⌈n^{1/3}⌉` consecutive records, seeded, so
//! reproducible): neighbouring requests of a learning logging policy are not independent;
//! for DR the fitted `q̂` is held fixed across resamples. The effective sample size is
//! `(Σw)²/Σw²`.
//!
//! The estimators are unbiased only where the log *supports* the target: every candidate the
//! target may choose must have been chosen by the logger with a known, non-zero probability.
//! [`SupportWarning`] names each way this fails; a caller should show them with the number.
//!
//! ```
//! use equiroute_core::ope::{evaluate, Estimator, LoggedDecision, OpeOptions};
//! // A uniform logger over two candidates; the target always picks candidate 1.
//! let log: Vec<LoggedDecision> = (0..4)
//!     .map(|i| LoggedDecision {
//!         features: vec![],
//!         eligible: vec![0, 1],
//!         action: i % 2,
//!         propensity: 0.5,
//!         propensity_exact: true,
//!         target: vec![0.0, 1.0],
//!         outcome: if i % 2 == 1 { 0.8 } else { 0.2 },
//!     })
//!     .collect();
//! let est = evaluate(&log, Estimator::Ips, &OpeOptions::default()).unwrap();
//! // (0 + 2·0.8 + 0 + 2·0.8) / 4 = 0.8
//! assert!((est.value - 0.8).abs() < 1e-12);
//! ```

use crate::estimators::linalg::spd_inverse;
use serde::{Deserialize, Serialize};
use std::fmt;
use thiserror::Error;

/// One logged decision, as an evaluator sees it. Indices are candidate indices of the
/// interface.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoggedDecision {
    /// The request's feature vector (may be empty).
    pub features: Vec<f64>,
    /// The eligible set at decision time.
    pub eligible: Vec<usize>,
    /// The candidate the logging policy put first.
    pub action: usize,
    /// The logging policy's probability of that first choice, in `(0, 1]`.
    pub propensity: f64,
    /// False when the logger was deterministic (propensity 1 "by construction").
    pub propensity_exact: bool,
    /// The evaluated policy's first-choice probabilities, indexed by candidate (sum 1 over
    /// `eligible`).
    pub target: Vec<f64>,
    /// The metric being evaluated for this request (quality, 1{deadline miss}, 1{bad}, cost).
    pub outcome: f64,
}

/// Which estimator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Estimator {
    /// Inverse propensity scoring: unbiased, high variance.
    Ips,
    /// Self-normalised IPS: slightly biased, bounded by the outcomes' range.
    Snips,
    /// Doubly robust: a cross-fitted reward model corrected by IPS on its residuals.
    Dr,
}

impl Estimator {
    /// All estimators, in documentation order.
    pub const ALL: [Estimator; 3] = [Estimator::Ips, Estimator::Snips, Estimator::Dr];

    /// The name used on command lines (`ips`, `snips`, `dr`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Estimator::Ips => "ips",
            Estimator::Snips => "snips",
            Estimator::Dr => "dr",
        }
    }
}

impl fmt::Display for Estimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Estimator {
    type Err = OpeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Estimator::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .ok_or_else(|| OpeError::UnknownEstimator { name: s.to_owned() })
    }
}

/// How to evaluate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OpeOptions {
    /// Coverage of the interval (default 0.95).
    pub confidence: f64,
    /// Bootstrap resamples over records for the interval (default 400).
    pub bootstrap_resamples: u32,
    /// Folds of DR's cross-fitting (default 5; at least 2).
    pub folds: u32,
    /// Propensities below this are "near zero" (default 0.005: weights above 200).
    pub min_propensity_warn: f64,
    /// An effective sample size below this is too thin to trust (default 100).
    pub min_effective_sample_size: f64,
    /// A candidate the target chooses with at least this mean mass must appear in the log
    /// (default 0.01).
    pub min_target_mass_warn: f64,
    /// Ridge penalty of DR's reward model (default 1).
    pub ridge: f64,
    /// A learning policy whose two replays ([`with_own_learning`]) differ by more than this
    /// many half-widths of the interval is warned about (default 0.5, chosen on the
    /// laboratory's seeds 1–5 against 1).
    pub learning_gap_warn: f64,
    /// Which comparison of a learning policy's replays warns ([`with_learning_replays`]).
    pub learning_check: LearningCheck,
    /// Length of the bootstrap's blocks of consecutive records (circular block bootstrap):
    /// 0 (the default) is `⌈n^{1/3}⌉`, the usual order for a block bootstrap's variance
    /// (Hall, Horowitz and Jing 1995); 1 is the iid bootstrap. Records must be in time
    /// order. Blocks keep what neighbouring requests share (the logging policy's state while
    /// it learns, a provider's episode) inside each resample; DR's cross-fitting folds are
    /// dealt in blocks of the same length, so that a record's reward model never saw its
    /// neighbours.
    pub bootstrap_block: u32,
    /// Records over which a candidate's recent share of the traffic is counted for the
    /// load-interference test (default 50; see [`SupportWarning::LoadDependent`]).
    pub load_window: u32,
    /// A candidate's outcome depends on its recent share when the regression slope's
    /// |t| exceeds this (default 3).
    pub load_t_warn: f64,
    /// Seed of the bootstrap.
    pub seed: u64,
}

impl Default for OpeOptions {
    fn default() -> Self {
        OpeOptions {
            confidence: 0.95,
            bootstrap_resamples: 400,
            folds: 5,
            min_propensity_warn: 0.005,
            min_effective_sample_size: 100.0,
            min_target_mass_warn: 0.01,
            ridge: 1.0,
            learning_gap_warn: 0.5,
            learning_check: LearningCheck::OwnVsSample,
            bootstrap_block: 0,
            load_window: 50,
            load_t_warn: 3.0,
            seed: 0,
        }
    }
}

/// Which comparison of a learning policy's replays ([`with_learning_replays`]) warns that
/// the estimate depends on what it learns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LearningCheck {
    /// Learning from every logged request against learning from a sample drawn as its own
    /// traffic would be (`all` vs `own`), beyond [`OpeOptions::learning_gap_warn`]
    /// half-widths. The own sample keeps about `c·n` requests (`c` the log's smallest
    /// propensity), so a policy that merely learns slowly is warned too.
    AllVsOwn,
    /// As [`LearningCheck::AllVsOwn`], and also the own sample against a uniformly random
    /// sample of the log of the same expected size (`own` vs `sample`), beyond the same
    /// threshold: a gap that the smaller sample alone explains (`own` close to `sample`) is
    /// not warned; one that learning on its own traffic adds is. Without a sample replay it
    /// is [`LearningCheck::AllVsOwn`].
    OwnVsSample,
}

/// An estimate of the target policy's mean outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub value: f64,
    /// Lower end of the bootstrap interval at [`OpeOptions::confidence`].
    pub ci_low: f64,
    /// Upper end of the interval.
    pub ci_high: f64,
    /// `(Σw)²/Σw²` with `w = target[action]/propensity`; `n` when the policies agree.
    pub effective_sample_size: f64,
    /// Records evaluated.
    pub n: usize,
    /// Why the number may not mean what it seems (empty when the log supports the target).
    pub warnings: Vec<SupportWarning>,
}

impl Estimate {
    /// Whether `x` lies in the interval.
    #[must_use]
    pub fn covers(&self, x: f64) -> bool {
        self.ci_low <= x && x <= self.ci_high
    }
}

/// A reason the log may not support the evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "warning", rename_all = "snake_case")]
pub enum SupportWarning {
    /// The logger was deterministic: the log only says what happens where the target agrees
    /// with it.
    DeterministicLogger,
    /// The target puts `target_mass` (mean over records) on a candidate the log never chose.
    UnsupportedAction { candidate: usize, target_mass: f64 },
    /// This share of the records has a propensity below the warning threshold.
    TinyPropensities { share: f64 },
    /// The importance weights leave this few effective records.
    LowEffectiveSampleSize { ess: f64 },
    /// The evaluated policy learns from the traffic, and what it learns matters: replayed
    /// learning only from a sample of the log drawn as its own traffic would be, it scores
    /// `own_value` instead of `value`, a gap above [`OpeOptions::learning_gap_warn`]
    /// half-widths of the interval (see [`with_learning_replays`]). With the
    /// [`LearningCheck::OwnVsSample`] check, `sample_value` is the replay learning from a
    /// uniformly random sample of the log of the same expected size, which `own_value` also
    /// differs from: the gap is not only the smaller sample's.
    LearningDependent {
        value: f64,
        own_value: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sample_value: Option<f64>,
    },
    /// Load interference: the outcome of requests sent to `candidate` moved with the share
    /// of the previous [`OpeOptions::load_window`] requests the logger sent it (`slope` per
    /// unit of share, `|t|` above [`OpeOptions::load_t_warn`]), and the evaluated policy would
    /// send it `target_share` of the traffic against the logged `logged_share`. Extrapolated
    /// along the slope, its outcome there would move the estimate by `shift`, more than
    /// [`OpeOptions::learning_gap_warn`] half-widths of the interval: the log shows the
    /// providers under the logger's load, not under the evaluated policy's.
    LoadDependent {
        candidate: usize,
        slope: f64,
        t: f64,
        logged_share: f64,
        target_share: f64,
        shift: f64,
    },
    /// A load-reactive target: the evaluated policy's first-choice probability of `candidate`
    /// moved with the share of the previous [`OpeOptions::load_window`] requests the logger
    /// sent it (`slope` per unit of share, `|t|` above [`OpeOptions::load_t_warn`]): it reads
    /// the load (in-flight counts, a rate limit's state). On its own traffic it would give the
    /// candidate `target_share` instead of the logged `logged_share`, so, extrapolated along
    /// the slope, it would choose it with about `own_share` instead of `target_share`, which
    /// moves the estimate by about `shift` (the moved choices valued at the logged mean
    /// outcomes), more than [`OpeOptions::learning_gap_warn`] half-widths of the interval.
    LoadReactive {
        candidate: usize,
        slope: f64,
        t: f64,
        logged_share: f64,
        target_share: f64,
        own_share: f64,
        shift: f64,
    },
}

impl fmt::Display for SupportWarning {
    /// The warning in words, naming a candidate by its index (`candidate 2`); a caller that
    /// knows the providers' ids uses [`SupportWarning::describe`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe(|c| format!("candidate {c}")))
    }
}

/// A metric's value in words: three decimals for quality and rates, three significant
/// digits for values below 0.01 (a cost per request of $5e-6 would print as 0.000).
fn significant(v: f64) -> String {
    if v == 0.0 || v.abs() >= 0.01 || !v.is_finite() {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

/// [`significant`] with its sign always shown (a shift of the estimate).
fn signed_significant(v: f64) -> String {
    if v.is_sign_negative() {
        significant(v)
    } else {
        format!("+{}", significant(v))
    }
}

impl SupportWarning {
    /// The candidate the warning is about, if any (its index in the log's index space).
    #[must_use]
    pub fn candidate(&self) -> Option<usize> {
        match self {
            SupportWarning::UnsupportedAction { candidate, .. }
            | SupportWarning::LoadDependent { candidate, .. }
            | SupportWarning::LoadReactive { candidate, .. } => Some(*candidate),
            _ => None,
        }
    }

    /// The warning in words, with candidate `c` named `name(c)`: the gateway and the CLI
    /// pass the provider's id (as the configuration and the audit log spell it), so the
    /// core stays free of the providers' names.
    #[must_use]
    pub fn describe(&self, name: impl Fn(usize) -> String) -> String {
        match self {
            SupportWarning::DeterministicLogger => "the logging policy was deterministic: the log only shows what happens when the \
                 evaluated policy makes the same choice, so the estimate is only valid for a policy \
                 that agrees with it; log with an exploration floor (min_propensity) to evaluate others".to_owned(),
            SupportWarning::UnsupportedAction {
                candidate,
                target_mass,
            } => format!(
                "the evaluated policy would put {} first on {:.1}% of requests, but the log never \
                 chose it: its outcome there is unknown (log with an exploration floor, min_propensity)",
                name(*candidate),
                100.0 * target_mass
            ),
            SupportWarning::TinyPropensities { share } => format!(
                "{:.1}% of the logged choices had a near-zero probability: a few records dominate \
                 the estimate",
                100.0 * share
            ),
            SupportWarning::LearningDependent {
                value,
                own_value,
                sample_value: None,
            } => format!(
                "the evaluated policy learns from the traffic, and the estimate depends on what it \
                 learns: learning from every logged request it scores {}, learning only from a \
                 sample of the log drawn as its own traffic would be {} (these two replays \
                 differ); its value on its own traffic may differ from both (the interval spans \
                 both replays)",
                significant(*value),
                significant(*own_value)
            ),
            SupportWarning::LearningDependent {
                value,
                own_value,
                sample_value: Some(sample_value),
            } => format!(
                "the evaluated policy learns from the traffic, and the estimate depends on what it \
                 learns: learning from every logged request it scores {}, learning only from a \
                 sample of the log drawn as its own traffic would be {}, and from a uniformly \
                 random sample of the log of the same size {} (the own-traffic replay differs \
                 from both, so not only the smaller sample moves it); its value on its own \
                 traffic may differ from all three (the interval spans the first two replays)",
                significant(*value),
                significant(*own_value),
                significant(*sample_value)
            ),
            SupportWarning::LoadDependent {
                candidate,
                slope,
                t,
                logged_share,
                target_share,
                shift,
            } => format!(
                "{}'s outcome depends on how much traffic it gets (slope {slope:+.3} per unit of \
                 its recent share, t = {t:.1}): the evaluated policy would send it {:.0}% of the \
                 requests, the logging policy sent it {:.0}%, which may move the estimate by about \
                 {}; the log shows it under the logging policy's load only",
                name(*candidate),
                100.0 * target_share,
                100.0 * logged_share,
                signed_significant(*shift)
            ),
            SupportWarning::LoadReactive {
                candidate,
                slope,
                t,
                logged_share,
                target_share,
                own_share,
                shift,
            } => format!(
                "the evaluated policy reacts to load: its probability of choosing {} moves with \
                 that provider's recent share of the traffic (slope {slope:+.3}, t = {t:.1}); it \
                 would send it {:.0}% of the requests where the logging policy sent {:.0}%, and \
                 under that load it would choose it about {:.0}% of the time, which may move the \
                 estimate by about {}: the log shows the providers under the logging \
                 policy's load only",
                name(*candidate),
                100.0 * target_share,
                100.0 * logged_share,
                100.0 * own_share,
                signed_significant(*shift)
            ),
            SupportWarning::LowEffectiveSampleSize { ess } => format!(
                "the evaluated policy differs so much from the logging policy that the log is worth \
                 only {ess:.0} requests: the interval is unreliable (collect more traffic or raise \
                 the exploration floor)"
            ),
        }
    }
}

/// The log or the options cannot be evaluated.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum OpeError {
    #[error("the log has no records: evaluate a log with at least one decision")]
    Empty,
    #[error("record {index}: `{field}` {problem}")]
    BadRecord {
        index: usize,
        field: &'static str,
        problem: String,
    },
    #[error("`{field}` = {value}: {fix}")]
    BadOption {
        field: &'static str,
        value: String,
        fix: &'static str,
    },
    #[error("unknown estimator `{name}`: use ips, snips or dr")]
    UnknownEstimator { name: String },
}

/// Estimates the target policy's mean outcome on the logged traffic.
///
/// # Errors
/// An empty log, a malformed record (propensity outside `(0, 1]`, an action outside the
/// eligible set, target probabilities that are not a distribution over the eligible set,
/// a non-finite outcome or feature, features of varying length), or options out of range.
pub fn evaluate(
    records: &[LoggedDecision],
    estimator: Estimator,
    opts: &OpeOptions,
) -> Result<Estimate, OpeError> {
    check_options(opts)?;
    if records.is_empty() {
        return Err(OpeError::Empty);
    }
    for (i, r) in records.iter().enumerate() {
        check_record(i, r, records[0].features.len())?;
    }
    let weights: Vec<f64> = records
        .iter()
        .map(|r| r.target[r.action] / r.propensity)
        .collect();
    // Per-record terms whose mean (IPS, DR) or ratio of sums (SNIPS) is the estimate.
    let terms: Vec<(f64, f64)> = match estimator {
        Estimator::Ips | Estimator::Snips => records
            .iter()
            .zip(&weights)
            .map(|(r, w)| (w * r.outcome, *w))
            .collect(),
        Estimator::Dr => {
            let q = cross_fitted_rewards(records, opts)?;
            records
                .iter()
                .zip(&weights)
                .zip(&q)
                .map(|((r, w), q)| {
                    let direct: f64 = r.eligible.iter().map(|&c| r.target[c] * q[c]).sum();
                    (direct + w * (r.outcome - q[r.action]), 1.0)
                })
                .collect()
        }
    };
    let combine = |sum_num: f64, sum_den: f64, n: usize| match estimator {
        Estimator::Snips if sum_den > 0.0 => sum_num / sum_den,
        // No weight at all: the target never agrees with the log; report 0, warned below.
        Estimator::Snips => 0.0,
        Estimator::Ips | Estimator::Dr => sum_num / n as f64,
    };
    let n = records.len();
    let (sn, sd) = terms
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let value = combine(sn, sd, n);

    let block = block_length(n, opts);
    let mut rng = SplitMix64(opts.seed ^ 0x6a09_e667_f3bc_c908);
    let mut boot: Vec<f64> = (0..opts.bootstrap_resamples)
        .map(|_| {
            let (mut a, mut b) = (0.0, 0.0);
            let mut taken = 0;
            // Circular block bootstrap: blocks of `block` consecutive records from uniform
            // starts, wrapping around, until n records (block 1: the iid bootstrap).
            while taken < n {
                let start = rng.below(n);
                for j in 0..block.min(n - taken) {
                    let (x, y) = terms[(start + j) % n];
                    a += x;
                    b += y;
                }
                taken += block;
            }
            combine(a, b, n)
        })
        .collect();
    boot.sort_by(f64::total_cmp);
    let tail = (1.0 - opts.confidence) / 2.0;
    let (ci_low, ci_high) = (quantile(&boot, tail), quantile(&boot, 1.0 - tail));

    let sum_w: f64 = weights.iter().sum();
    let sum_w2: f64 = weights.iter().map(|w| w * w).sum();
    let ess = if sum_w2 > 0.0 {
        sum_w * sum_w / sum_w2
    } else {
        0.0
    };
    let (ci_low, ci_high) = (ci_low.min(value), ci_high.max(value));
    let mut warnings = support_warnings(records, ess, opts);
    let half_width = opts.learning_gap_warn * (ci_high - ci_low) / 2.0;
    warnings.extend(load_warnings(records, half_width, opts));
    Ok(Estimate {
        value,
        ci_low,
        ci_high,
        effective_sample_size: ess,
        n,
        warnings,
    })
}

/// The bootstrap's block length for `n` records: [`OpeOptions::bootstrap_block`], or
/// `⌈n^{1/3}⌉` when it is 0; at most `n`.
#[must_use]
pub fn block_length(n: usize, opts: &OpeOptions) -> usize {
    let l = match opts.bootstrap_block {
        0 => (n as f64).cbrt().ceil() as usize,
        b => b as usize,
    };
    l.clamp(1, n.max(1))
}

/// The load-interference test ([`SupportWarning::LoadDependent`]). For each candidate, the
/// outcomes of the requests the logger sent it are regressed (least squares) on its share
/// of the previous `load_window` requests; a slope with `|t| > load_t_warn` says its outcome
/// depends on its load. Then, were the evaluated policy to send it its own share instead
/// of the logged one, its outcome would move by `slope·(target − logged share)` on the
/// target's share of the requests: warned when that shift of the estimate exceeds
/// `max_shift`. Records must be in time order.
#[must_use]
pub fn load_warnings(
    records: &[LoggedDecision],
    max_shift: f64,
    opts: &OpeOptions,
) -> Vec<SupportWarning> {
    let window = opts.load_window as usize;
    let n = records.len();
    if window == 0 || n <= window {
        return Vec::new();
    }
    let k = records
        .iter()
        .map(|r| r.target.len().max(r.action + 1))
        .max()
        .unwrap_or(0);
    // Per candidate: (share, outcome) of the requests it was sent after the first window,
    // and (share, target probability) of every request.
    let mut points: Vec<Vec<(f64, f64)>> = vec![Vec::new(); k];
    let mut reaction: Vec<Vec<(f64, f64)>> = vec![Vec::new(); k];
    let mut counts = vec![0usize; k];
    for r in &records[..window] {
        counts[r.action] += 1;
    }
    let mut logged_share = vec![0.0; k];
    for i in window..n {
        let r = &records[i];
        points[r.action].push((counts[r.action] as f64 / window as f64, r.outcome));
        for (c, share) in logged_share.iter_mut().enumerate() {
            let now = counts[c] as f64 / window as f64;
            *share += now;
            reaction[c].push((now, r.target.get(c).copied().unwrap_or(0.0)));
        }
        counts[r.action] += 1;
        counts[records[i - window].action] -= 1;
    }
    let m = (n - window) as f64;
    let target_share: Vec<f64> = (0..k)
        .map(|c| {
            records
                .iter()
                .map(|r| r.target.get(c).copied().unwrap_or(0.0))
                .sum::<f64>()
                / n as f64
        })
        .collect();
    let mean_outcome: Vec<Option<f64>> = points
        .iter()
        .map(|p| (!p.is_empty()).then(|| p.iter().map(|(_, y)| y).sum::<f64>() / p.len() as f64))
        .collect();
    let mut out = Vec::new();
    for (c, pts) in reaction.iter().enumerate() {
        let Some((slope, t)) = slope_t(pts) else {
            continue;
        };
        let (logged, target) = (logged_share[c] / m, target_share[c]);
        let own = (target + slope * (target - logged)).clamp(0.0, 1.0);
        // The choices moved to or from c, valued at c's logged mean outcome against the
        // target's other choices' (its own shares, logged means).
        let (mut num, mut den) = (0.0, 0.0);
        for (c2, share) in target_share.iter().enumerate() {
            if let (true, Some(y)) = (c2 != c, mean_outcome[c2]) {
                num += share * y;
                den += share;
            }
        }
        let (Some(y_c), true) = (mean_outcome[c], den > 0.0) else {
            continue;
        };
        let shift = (own - target) * (y_c - num / den);
        if t.abs() > opts.load_t_warn && shift.abs() > max_shift {
            out.push(SupportWarning::LoadReactive {
                candidate: c,
                slope,
                t,
                logged_share: logged,
                target_share: target,
                own_share: own,
                shift,
            });
        }
    }
    for (c, pts) in points.iter().enumerate() {
        let Some((slope, t)) = slope_t(pts) else {
            continue;
        };
        let (logged, target) = (logged_share[c] / m, target_share[c]);
        let shift = target * slope * (target - logged);
        if t.abs() > opts.load_t_warn && shift.abs() > max_shift {
            out.push(SupportWarning::LoadDependent {
                candidate: c,
                slope,
                t,
                logged_share: logged,
                target_share: target,
                shift,
            });
        }
    }
    out
}

/// Least-squares slope of `y` on `x` and its t statistic; `None` with fewer than 30 points
/// or no spread in `x` (too little to test).
fn slope_t(pts: &[(f64, f64)]) -> Option<(f64, f64)> {
    if pts.len() < 30 {
        return None;
    }
    let m = pts.len() as f64;
    let (mx, my) = pts
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / m, b + y / m));
    let sxx: f64 = pts.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    if sxx <= 1e-12 {
        return None;
    }
    let slope = pts.iter().map(|(x, y)| (x - mx) * (y - my)).sum::<f64>() / sxx;
    let ssr: f64 = pts
        .iter()
        .map(|(x, y)| (y - my - slope * (x - mx)).powi(2))
        .sum();
    let se = (ssr / (m - 2.0) / sxx).sqrt();
    let t = if se > 0.0 {
        slope / se
    } else if slope == 0.0 {
        0.0
    } else {
        f64::INFINITY.copysign(slope)
    };
    Some((slope, t))
}

/// Combines the estimates of one policy replayed twice on the same log: learning from every
/// logged request (`all`, the estimate reported) and learning only from a sample of the log
/// drawn as its own traffic would be (`own`, [`learns_as_own`]). A policy that does not
/// learn gives the same number twice. Where they differ, what the policy learns from the
/// traffic is part of the uncertainty: the interval is widened to span both intervals, and
/// when the gap exceeds [`OpeOptions::learning_gap_warn`] half-widths of `all`'s interval the
/// estimate carries [`SupportWarning::LearningDependent`]. [`with_learning_replays`] without a
/// sample replay.
#[must_use]
pub fn with_own_learning(all: Estimate, own: &Estimate, opts: &OpeOptions) -> Estimate {
    with_learning_replays(all, own, None, opts)
}

/// Combines the estimates of one policy replayed on the same log learning from every logged
/// request (`all`, the estimate reported), from a sample drawn as its own traffic would be
/// (`own`, [`learns_as_own`]: about `c·n` requests) and, optionally, from a uniformly random
/// sample of the log of the same expected size (`sample`, [`learns_as_sample`]). `all` vs
/// `sample` is what learning from fewer requests alone changes; `own` vs `sample` is what
/// learning on its own traffic changes at equal size. The interval spans `all`'s and `own`'s
/// (the sample replay does not narrow or widen it). The estimate is warned
/// ([`SupportWarning::LearningDependent`]) when `all` and `own` differ by more than
/// [`OpeOptions::learning_gap_warn`] half-widths of `all`'s interval and, with
/// [`LearningCheck::OwnVsSample`] and a `sample`, `own` and `sample` differ by more than the
/// same: a slow learner whose own and random samples agree is not warned.
#[must_use]
pub fn with_learning_replays(
    all: Estimate,
    own: &Estimate,
    sample: Option<&Estimate>,
    opts: &OpeOptions,
) -> Estimate {
    let half_width = opts.learning_gap_warn * (all.ci_high - all.ci_low) / 2.0;
    let mut out = Estimate {
        ci_low: all.ci_low.min(own.ci_low),
        ci_high: all.ci_high.max(own.ci_high),
        ..all
    };
    let sample = match opts.learning_check {
        LearningCheck::AllVsOwn => None,
        LearningCheck::OwnVsSample => sample,
    };
    let all_vs_own = (out.value - own.value).abs() > half_width;
    let own_vs_sample = sample.is_none_or(|s| (own.value - s.value).abs() > half_width);
    if all_vs_own && own_vs_sample {
        out.warnings.push(SupportWarning::LearningDependent {
            value: out.value,
            own_value: own.value,
            sample_value: sample.map(|s| s.value),
        });
    }
    out
}

/// Whether a replay learning only from its own choices learns from this request: with
/// probability `min(1, target[action]/propensity)`, given a uniform draw `u` in `[0, 1)`.
/// The requests learnt from then have the target's own first choices (exactly, for a
/// deterministic target), but not its own mix of contexts: a request is kept more often
/// where the logger was likely to make the target's choice, so the target learns most where
/// it agrees with the logger. [`learns_as_own`] keeps the mix.
#[must_use]
pub fn learns_from(target_probability: f64, propensity: f64, u: f64) -> bool {
    propensity > 0.0 && u < (target_probability / propensity).min(1.0)
}

/// Rejection sampling with a constant bound (Li, Chu, Langford and Wang 2011): a request is
/// learnt from with probability `bound·target[action]/propensity`, given a uniform draw `u`
/// in `[0, 1)`, `bound` at most every logged propensity ([`rejection_bound`]). Every request
/// is then kept with the same probability `bound` whatever its context, and a kept request's
/// (context, first choice) is distributed as on the target's own traffic: the target learns
/// from a sample of what it would have seen itself, not from the contexts where it happens
/// to agree with the logger ([`learns_from`]). The price: it learns from about `bound·n` of
/// `n` requests.
#[must_use]
pub fn learns_as_own(target_probability: f64, propensity: f64, bound: f64, u: f64) -> bool {
    propensity > 0.0 && u < (bound * target_probability / propensity).min(1.0)
}

/// Whether a replay learning from a uniformly random sample of the log learns from this
/// request: with probability `bound` whatever the target would choose, given a uniform draw
/// `u` in `[0, 1)`. With the bound of [`learns_as_own`], the sample has the same expected size
/// as the own sample (about `bound·n` requests) but the logger's mix of contexts and choices:
/// the two differ only by what the target would have chosen, so comparing them tells what
/// learning on its own traffic changes from what a smaller sample alone changes. Drawn with
/// the same `u` as [`learns_as_own`], a request kept by one is kept by the other wherever the
/// target's probability of the logged choice equals its propensity.
#[must_use]
pub fn learns_as_sample(bound: f64, u: f64) -> bool {
    u < bound
}

/// The bound of [`learns_as_own`] for a log: its smallest propensity (0 for an empty log).
#[must_use]
pub fn rejection_bound(propensities: impl IntoIterator<Item = f64>) -> f64 {
    let min = propensities
        .into_iter()
        .filter(|p| *p > 0.0)
        .fold(f64::INFINITY, f64::min);
    if min.is_finite() {
        min.min(1.0)
    } else {
        0.0
    }
}

/// What may make an evaluation of this log meaningless, whatever the estimator.
#[must_use]
pub fn support_warnings(
    records: &[LoggedDecision],
    ess: f64,
    opts: &OpeOptions,
) -> Vec<SupportWarning> {
    let mut out = Vec::new();
    if records.is_empty() {
        return out;
    }
    let n = records.len() as f64;
    if records.iter().any(|r| !r.propensity_exact) {
        out.push(SupportWarning::DeterministicLogger);
    }
    let k = records
        .iter()
        .map(|r| r.target.len())
        .max()
        .unwrap_or(0)
        .max(records.iter().map(|r| r.action + 1).max().unwrap_or(0));
    let mut chosen = vec![false; k];
    let mut mass = vec![0.0; k];
    for r in records {
        chosen[r.action] = true;
        for &c in &r.eligible {
            mass[c] += r.target.get(c).copied().unwrap_or(0.0);
        }
    }
    for m in &mut mass {
        *m /= n;
    }
    for c in 0..k {
        if !chosen[c] && mass[c] >= opts.min_target_mass_warn {
            out.push(SupportWarning::UnsupportedAction {
                candidate: c,
                target_mass: mass[c],
            });
        }
    }
    let tiny = records
        .iter()
        .filter(|r| r.propensity < opts.min_propensity_warn)
        .count();
    if tiny > 0 {
        out.push(SupportWarning::TinyPropensities {
            share: tiny as f64 / n,
        });
    }
    if ess < opts.min_effective_sample_size {
        out.push(SupportWarning::LowEffectiveSampleSize { ess });
    }
    out
}

fn bad_option(field: &'static str, value: impl fmt::Display, fix: &'static str) -> OpeError {
    OpeError::BadOption {
        field,
        value: value.to_string(),
        fix,
    }
}

fn check_options(o: &OpeOptions) -> Result<(), OpeError> {
    if !(o.confidence > 0.0 && o.confidence < 1.0) {
        return Err(bad_option(
            "confidence",
            o.confidence,
            "must be in (0, 1), e.g. 0.95",
        ));
    }
    if o.bootstrap_resamples == 0 || o.bootstrap_resamples > 100_000 {
        return Err(bad_option(
            "bootstrap_resamples",
            o.bootstrap_resamples,
            "must be in 1..=100000 (400 is plenty for a 95% interval)",
        ));
    }
    if o.folds < 2 || o.folds > 100 {
        return Err(bad_option(
            "folds",
            o.folds,
            "must be in 2..=100 (cross-fitting needs at least two folds; 5 is usual)",
        ));
    }
    if !(o.min_propensity_warn >= 0.0 && o.min_propensity_warn < 1.0) {
        return Err(bad_option(
            "min_propensity_warn",
            o.min_propensity_warn,
            "must be in [0, 1), e.g. 0.005",
        ));
    }
    if !(o.min_effective_sample_size >= 0.0 && o.min_effective_sample_size.is_finite()) {
        return Err(bad_option(
            "min_effective_sample_size",
            o.min_effective_sample_size,
            "must be a finite number of at least 0, e.g. 100",
        ));
    }
    if !(0.0..=1.0).contains(&o.min_target_mass_warn) {
        return Err(bad_option(
            "min_target_mass_warn",
            o.min_target_mass_warn,
            "must be in [0, 1], e.g. 0.01",
        ));
    }
    if !(o.learning_gap_warn >= 0.0 && o.learning_gap_warn.is_finite()) {
        return Err(bad_option(
            "learning_gap_warn",
            o.learning_gap_warn,
            "must be a finite number of half-widths, at least 0, e.g. 0.5",
        ));
    }
    if !(o.load_t_warn > 0.0 && o.load_t_warn.is_finite()) {
        return Err(bad_option(
            "load_t_warn",
            o.load_t_warn,
            "must be a finite t statistic above 0, e.g. 3",
        ));
    }
    if !(o.ridge > 0.0 && o.ridge.is_finite()) {
        return Err(bad_option(
            "ridge",
            o.ridge,
            "must be a finite number above 0, e.g. 1",
        ));
    }
    Ok(())
}

fn check_record(index: usize, r: &LoggedDecision, dim: usize) -> Result<(), OpeError> {
    let bad = |field, problem: String| {
        Err(OpeError::BadRecord {
            index,
            field,
            problem,
        })
    };
    if !(r.propensity > 0.0 && r.propensity <= 1.0) {
        return bad(
            "propensity",
            format!(
                "= {}: must be in (0, 1] (a choice the logger could not make cannot be in its log)",
                r.propensity
            ),
        );
    }
    if !r.eligible.contains(&r.action) {
        return bad(
            "action",
            format!(
                "= {}: must be one of the eligible candidates {:?}",
                r.action, r.eligible
            ),
        );
    }
    if let Some(&c) = r.eligible.iter().find(|&&c| c >= r.target.len()) {
        return bad(
            "target",
            format!(
                "has {} probabilities but eligible candidate {c} needs index {c}: give one per candidate",
                r.target.len()
            ),
        );
    }
    if r.target.iter().any(|p| !(0.0..=1.0 + 1e-9).contains(p)) {
        return bad("target", "holds a value outside [0, 1]".to_owned());
    }
    let total: f64 = r.eligible.iter().map(|&c| r.target[c]).sum();
    if (total - 1.0).abs() > 1e-6 {
        return bad(
            "target",
            format!("sums to {total} over the eligible candidates: it must sum to 1"),
        );
    }
    if !r.outcome.is_finite() {
        return bad("outcome", "is not a finite number".to_owned());
    }
    if r.features.len() != dim {
        return bad(
            "features",
            format!(
                "has {} dimensions, record 0 has {dim}: every record needs the same features",
                r.features.len()
            ),
        );
    }
    if r.features.iter().any(|x| !x.is_finite()) {
        return bad("features", "holds a non-finite number".to_owned());
    }
    Ok(())
}

/// `q̂(x, c)` for every record and candidate, each predicted by a model that did not see the
/// record: blocks of [`block_length`] consecutive records are dealt into folds round-robin
/// (so every fold spans the whole log, drift included, and no record's model saw its
/// neighbours), and each fold is predicted by ridge regressions fitted on the other folds.
fn cross_fitted_rewards(
    records: &[LoggedDecision],
    opts: &OpeOptions,
) -> Result<Vec<Vec<f64>>, OpeError> {
    let n = records.len();
    let k = records
        .iter()
        .map(|r| r.target.len().max(r.action + 1))
        .max()
        .unwrap_or(0);
    let folds = (opts.folds as usize).min(n).max(1);
    let block = block_length(n, opts);
    let fold_of = |i: usize| (i / block) % folds;
    let mut out = vec![vec![0.0; k]; n];
    for fold in 0..folds {
        let train = records
            .iter()
            .enumerate()
            .filter(|(i, _)| folds == 1 || fold_of(*i) != fold)
            .map(|(_, r)| r);
        let model = RewardModel::fit(train, k, opts.ridge)?;
        for (i, r) in records.iter().enumerate() {
            if fold_of(i) == fold {
                for (c, q) in out[i].iter_mut().enumerate() {
                    *q = model.predict(c, &r.features);
                }
            }
        }
    }
    Ok(out)
}

/// One ridge regression per candidate on `[1, x]`; a candidate without data predicts the
/// mean outcome of the training records (of any candidate).
struct RewardModel {
    /// Per candidate: coefficients on `[1, x]`, or `None` without data.
    coefficients: Vec<Option<Vec<f64>>>,
    fallback: f64,
}

impl RewardModel {
    fn fit<'a>(
        records: impl Iterator<Item = &'a LoggedDecision>,
        k: usize,
        ridge: f64,
    ) -> Result<RewardModel, OpeError> {
        let mut gram: Vec<Option<(Vec<f64>, Vec<f64>)>> = vec![None; k];
        let (mut total, mut count) = (0.0, 0usize);
        let mut d = 1;
        for r in records {
            d = r.features.len() + 1;
            total += r.outcome;
            count += 1;
            let (a, b) = gram[r.action].get_or_insert_with(|| (vec![0.0; d * d], vec![0.0; d]));
            let z = |j: usize| if j == 0 { 1.0 } else { r.features[j - 1] };
            for i in 0..d {
                b[i] += r.outcome * z(i);
                for j in 0..d {
                    a[i * d + j] += z(i) * z(j);
                }
            }
        }
        let fallback = if count > 0 { total / count as f64 } else { 0.0 };
        let mut coefficients = Vec::with_capacity(k);
        for g in gram {
            coefficients.push(match g {
                None => None,
                Some((mut a, b)) => {
                    // Ridge on the slopes only, toward the fallback mean via the intercept:
                    // a thin candidate predicts close to its own mean.
                    for i in 1..d {
                        a[i * d + i] += ridge;
                    }
                    a[0] += 1e-9;
                    let inv = spd_inverse(&a, d).ok_or(OpeError::BadOption {
                        field: "ridge",
                        value: ridge.to_string(),
                        fix: "the reward model's normal equations are singular: raise the ridge penalty",
                    })?;
                    Some(
                        (0..d)
                            .map(|i| (0..d).map(|j| inv[i * d + j] * b[j]).sum())
                            .collect(),
                    )
                }
            });
        }
        Ok(RewardModel {
            coefficients,
            fallback,
        })
    }

    fn predict(&self, c: usize, x: &[f64]) -> f64 {
        match self.coefficients.get(c) {
            Some(Some(theta)) => {
                theta[0] + theta[1..].iter().zip(x).map(|(t, x)| t * x).sum::<f64>()
            }
            _ => self.fallback,
        }
    }
}

/// The `p`-quantile of sorted `xs` (linear interpolation between order statistics).
fn quantile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let pos = p.clamp(0.0, 1.0) * (xs.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    xs[lo] + (xs[hi] - xs[lo]) * (pos - lo as f64)
}

/// A tiny seeded generator for the bootstrap, so that intervals do not change with the
/// `rand` crate's version.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n ≥ 1), by multiply-shift (bias below 2⁻³²).
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next()) * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(action: u32, propensity: f64, target: [f64; 2], outcome: f64) -> LoggedDecision {
        LoggedDecision {
            features: vec![],
            eligible: vec![0, 1],
            action: action as usize,
            propensity,
            propensity_exact: true,
            target: target.to_vec(),
            outcome,
        }
    }

    /// A 2-arm log on paper: the logger picks arm 0 with 0.8, arm 1 with 0.2.
    /// Records: (0, y=1), (0, y=0), (0, y=1), (1, y=1), (0, y=0).
    /// Target: arm 1 with 0.5. Weights: arm 0 → 0.5/0.8 = 0.625, arm 1 → 0.5/0.2 = 2.5.
    fn paper_log() -> Vec<LoggedDecision> {
        [(0, 1.0), (0, 0.0), (0, 1.0), (1, 1.0), (0, 0.0)]
            .into_iter()
            .map(|(a, y)| rec(a, if a == 0 { 0.8 } else { 0.2 }, [0.5, 0.5], y))
            .collect()
    }

    #[test]
    fn ips_and_snips_match_the_paper_computation() {
        let o = OpeOptions::default();
        let ips = evaluate(&paper_log(), Estimator::Ips, &o).unwrap();
        // (0.625 + 0 + 0.625 + 2.5 + 0) / 5 = 3.75 / 5 = 0.75
        assert!((ips.value - 0.75).abs() < 1e-12, "{}", ips.value);
        let snips = evaluate(&paper_log(), Estimator::Snips, &o).unwrap();
        // 3.75 / (4·0.625 + 2.5) = 3.75 / 5 = 0.75
        assert!((snips.value - 0.75).abs() < 1e-12, "{}", snips.value);
        // ESS = 5² / (4·0.625² + 2.5²) = 25 / 7.8125 = 3.2
        assert!((ips.effective_sample_size - 3.2).abs() < 1e-12);
        assert_eq!(ips.n, 5);
        assert!(ips.ci_low <= ips.value && ips.value <= ips.ci_high);
    }

    #[test]
    fn snips_differs_from_ips_when_weights_do_not_average_one() {
        // Target always arm 1: weights 0 (arm 0) and 5 (arm 1). One arm-1 record of five:
        // IPS = 5·1/5 = 1; SNIPS = 5/5 = 1. With y=0.6 on it: IPS 0.6, SNIPS 0.6.
        // Two arm-1 records (y=1, y=0.5) of five: IPS = (5 + 2.5)/5 = 1.5, SNIPS = 7.5/10 = 0.75.
        let mut log = vec![
            rec(0, 0.8, [0.0, 1.0], 1.0),
            rec(0, 0.8, [0.0, 1.0], 1.0),
            rec(0, 0.8, [0.0, 1.0], 1.0),
        ];
        log.push(rec(1, 0.2, [0.0, 1.0], 1.0));
        log.push(rec(1, 0.2, [0.0, 1.0], 0.5));
        let o = OpeOptions::default();
        assert!((evaluate(&log, Estimator::Ips, &o).unwrap().value - 1.5).abs() < 1e-12);
        assert!((evaluate(&log, Estimator::Snips, &o).unwrap().value - 0.75).abs() < 1e-12);
    }

    #[test]
    fn dr_with_a_constant_reward_per_arm_is_exact() {
        // Arm 0 always scores 0.2, arm 1 always 0.9; a uniform logger. With no features the
        // reward model is each arm's mean, which cross-fitting still gets exactly right, so
        // every residual is 0 and DR = Σ target·q̂ = 0.3·0.2 + 0.7·0.9 = 0.69 with a zero-width
        // interval; IPS is only right on average.
        let log: Vec<LoggedDecision> = (0..40)
            .map(|i| {
                let a = u32::from(i % 4 == 1 || i % 4 == 2);
                rec(a, 0.5, [0.3, 0.7], if a == 0 { 0.2 } else { 0.9 })
            })
            .collect();
        let o = OpeOptions::default();
        let dr = evaluate(&log, Estimator::Dr, &o).unwrap();
        assert!((dr.value - 0.69).abs() < 1e-6, "{}", dr.value);
        assert!(dr.ci_high - dr.ci_low < 1e-6);
        let ips = evaluate(&log, Estimator::Ips, &o).unwrap();
        // Half the records each: (20·0.6·0.2 + 20·1.4·0.9)/40 = (2.4 + 25.2)/40 = 0.69.
        assert!((ips.value - 0.69).abs() < 1e-12);
    }

    #[test]
    fn dr_fits_a_linear_reward_from_the_features() {
        // y = 0.5·x for arm 0 and 1 − 0.5·x for arm 1, x in [0, 1]; the target picks arm 1
        // when x < 0.5, arm 0 otherwise. Its true value is the mean of its arms' rewards over the grid.
        let log: Vec<LoggedDecision> = (0..200u32)
            .map(|i| {
                let x = f64::from(i % 20) / 19.0;
                let a = (i / 20) % 2;
                let target = if x < 0.5 { [0.0, 1.0] } else { [1.0, 0.0] };
                let y = if a == 0 { 0.5 * x } else { 1.0 - 0.5 * x };
                LoggedDecision {
                    features: vec![x],
                    ..rec(a, 0.5, target, y)
                }
            })
            .collect();
        let truth: f64 = (0..20)
            .map(|i| {
                let x = f64::from(i) / 19.0;
                if x < 0.5 {
                    1.0 - 0.5 * x
                } else {
                    0.5 * x
                }
            })
            .sum::<f64>()
            / 20.0;
        let o = OpeOptions {
            ridge: 1e-6,
            ..OpeOptions::default()
        };
        let dr = evaluate(&log, Estimator::Dr, &o).unwrap();
        assert!((dr.value - truth).abs() < 1e-3, "{} vs {truth}", dr.value);
        assert!(dr.covers(truth));
    }

    #[test]
    fn the_interval_is_reproducible_from_the_seed_and_changes_with_it() {
        let log: Vec<LoggedDecision> = (0..60u32)
            .map(|i| rec(i % 2, 0.5, [0.4, 0.6], f64::from(i % 7) / 7.0))
            .collect();
        let o = OpeOptions::default();
        let a = evaluate(&log, Estimator::Ips, &o).unwrap();
        let b = evaluate(&log, Estimator::Ips, &o).unwrap();
        assert_eq!(a, b);
        assert!(a.ci_low < a.value && a.value < a.ci_high, "{a:?}");
        let c = evaluate(&log, Estimator::Ips, &OpeOptions { seed: 9, ..o }).unwrap();
        assert!(
            (a.ci_low - c.ci_low).abs() + (a.ci_high - c.ci_high).abs() > 1e-12,
            "{a:?} {c:?}"
        );
    }

    #[test]
    fn a_deterministic_logger_and_an_unsupported_arm_are_warned() {
        // The logger always picked arm 0 "with probability 1"; the target wants arm 1.
        let log: Vec<LoggedDecision> = (0..10)
            .map(|_| LoggedDecision {
                propensity_exact: false,
                ..rec(0, 1.0, [0.0, 1.0], 0.5)
            })
            .collect();
        let e = evaluate(&log, Estimator::Ips, &OpeOptions::default()).unwrap();
        assert!(e.warnings.contains(&SupportWarning::DeterministicLogger));
        assert!(e.warnings.contains(&SupportWarning::UnsupportedAction {
            candidate: 1,
            target_mass: 1.0
        }));
        assert!(e
            .warnings
            .iter()
            .any(|w| matches!(w, SupportWarning::LowEffectiveSampleSize { ess } if *ess == 0.0)));
        let text = SupportWarning::DeterministicLogger.to_string();
        assert!(text.contains("exploration floor"), "{text}");
    }

    #[test]
    fn near_zero_propensities_are_warned_with_their_share() {
        let mut log = paper_log();
        log[3].propensity = 0.001;
        let e = evaluate(&log, Estimator::Snips, &OpeOptions::default()).unwrap();
        assert!(e
            .warnings
            .contains(&SupportWarning::TinyPropensities { share: 0.2 }));
    }

    #[test]
    fn bad_records_and_options_name_the_field() {
        let o = OpeOptions::default();
        assert_eq!(evaluate(&[], Estimator::Ips, &o), Err(OpeError::Empty));
        let mut log = paper_log();
        log[2].propensity = 0.0;
        let e = evaluate(&log, Estimator::Ips, &o).unwrap_err().to_string();
        assert!(e.contains("record 2") && e.contains("propensity"), "{e}");
        let mut log = paper_log();
        log[1].target = vec![0.5, 0.6];
        let e = evaluate(&log, Estimator::Ips, &o).unwrap_err().to_string();
        assert!(e.contains("sums to"), "{e}");
        let mut log = paper_log();
        log[0].action = 7;
        assert!(evaluate(&log, Estimator::Ips, &o).is_err());
        let e = evaluate(&paper_log(), Estimator::Dr, &OpeOptions { folds: 1, ..o })
            .unwrap_err()
            .to_string();
        assert!(e.contains("folds"), "{e}");
        assert_eq!("dr".parse::<Estimator>(), Ok(Estimator::Dr));
        assert!("xyz".parse::<Estimator>().is_err());
    }

    fn estimate(value: f64, ci_low: f64, ci_high: f64) -> Estimate {
        Estimate {
            value,
            ci_low,
            ci_high,
            effective_sample_size: 100.0,
            n: 100,
            warnings: Vec::new(),
        }
    }

    #[test]
    fn two_replays_widen_the_interval_and_warn_beyond_its_half_width() {
        // Warned beyond one half-width here. Learning from all: 0.60 in [0.56, 0.64]
        // (half-width 0.04). Learning from its own choices: 0.63 in [0.58, 0.69]: a gap of
        // 0.03, within 0.04, so no warning, and the interval spans both: [0.56, 0.69].
        let o = OpeOptions {
            learning_gap_warn: 1.0,
            ..OpeOptions::default()
        };
        let e = with_own_learning(estimate(0.60, 0.56, 0.64), &estimate(0.63, 0.58, 0.69), &o);
        assert!((e.value - 0.60).abs() < 1e-12);
        assert!((e.ci_low - 0.56).abs() < 1e-12 && (e.ci_high - 0.69).abs() < 1e-12);
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
        // Own: 0.65 in [0.61, 0.70]: a gap of 0.05 > 0.04, warned with both values.
        let e = with_own_learning(estimate(0.60, 0.56, 0.64), &estimate(0.65, 0.61, 0.70), &o);
        assert!((e.ci_low - 0.56).abs() < 1e-12 && (e.ci_high - 0.70).abs() < 1e-12);
        assert_eq!(
            e.warnings,
            vec![SupportWarning::LearningDependent {
                value: 0.60,
                own_value: 0.65,
                sample_value: None,
            }]
        );
        let text = e.warnings[0].to_string();
        assert!(text.contains("0.600") && text.contains("0.650"), "{text}");
        // A cost per request keeps its digits: $5.10e-6 against $4.96e-6, not 0.000 twice.
        let cost = SupportWarning::LearningDependent {
            value: 5.1e-6,
            own_value: 4.96e-6,
            sample_value: None,
        }
        .to_string();
        assert!(
            cost.contains("5.10e-6") && cost.contains("4.96e-6"),
            "{cost}"
        );
        // A policy that does not learn gives the same estimate twice: nothing changes.
        let same = estimate(0.60, 0.56, 0.64);
        assert_eq!(with_own_learning(same.clone(), &same, &o), same);
        // By default, beyond half a half-width (0.02): the 0.03 gap is warned.
        let e = with_own_learning(
            estimate(0.60, 0.56, 0.64),
            &estimate(0.63, 0.58, 0.69),
            &OpeOptions::default(),
        );
        assert_eq!(e.warnings.len(), 1, "{:?}", e.warnings);
    }

    #[test]
    fn a_slow_learner_whose_own_and_random_samples_agree_is_not_warned() {
        // Default: warned beyond half a half-width. All: 0.60 in [0.56, 0.64], so 0.02.
        let all = estimate(0.60, 0.56, 0.64);
        let o = OpeOptions::default();
        assert_eq!(o.learning_check, LearningCheck::OwnVsSample);
        // A slow learner: from ~c·n requests it scores 0.65 on its own sample and 0.64 on a
        // random sample of the same size. All vs own: 0.05 > 0.02, but own vs sample: 0.01,
        // within 0.02: the smaller sample explains the gap, not warned. The interval still
        // spans all and own: [0.56, 0.70].
        let own = estimate(0.65, 0.61, 0.70);
        let e = with_learning_replays(all.clone(), &own, Some(&estimate(0.64, 0.60, 0.69)), &o);
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
        assert!((e.value - 0.60).abs() < 1e-12);
        assert!((e.ci_low - 0.56).abs() < 1e-12 && (e.ci_high - 0.70).abs() < 1e-12);
        // The rule before (all vs own only) warns the same replays.
        let before = OpeOptions {
            learning_check: LearningCheck::AllVsOwn,
            ..o
        };
        let e = with_learning_replays(
            all.clone(),
            &own,
            Some(&estimate(0.64, 0.60, 0.69)),
            &before,
        );
        assert_eq!(e.warnings.len(), 1, "{:?}", e.warnings);
        assert_eq!(e, with_own_learning(all.clone(), &own, &before));
        // One that learns differently on its own traffic: the random sample scores 0.61, own
        // vs sample 0.04 > 0.02: warned, with the three values in the text.
        let e = with_learning_replays(all.clone(), &own, Some(&estimate(0.61, 0.57, 0.65)), &o);
        assert_eq!(
            e.warnings,
            vec![SupportWarning::LearningDependent {
                value: 0.60,
                own_value: 0.65,
                sample_value: Some(0.61),
            }]
        );
        let text = e.warnings[0].to_string();
        assert!(
            text.contains("0.600") && text.contains("0.650") && text.contains("0.610"),
            "{text}"
        );
        assert!(text.contains("random sample"), "{text}");
        // Own close to all (0.61, within 0.02) is not warned, however far the sample is.
        let e = with_learning_replays(
            all.clone(),
            &estimate(0.61, 0.57, 0.65),
            Some(&estimate(0.50, 0.46, 0.54)),
            &o,
        );
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
        // Without a sample replay, the check is all vs own.
        let e = with_learning_replays(all, &own, None, &o);
        assert_eq!(e.warnings.len(), 1, "{:?}", e.warnings);
    }

    /// A log whose IPS terms are exactly `ys` (the target agrees with a logger that reported
    /// probability 1), in time order.
    fn plain_log(ys: &[f64]) -> Vec<LoggedDecision> {
        ys.iter().map(|&y| rec(0, 1.0, [1.0, 0.0], y)).collect()
    }

    fn width(e: &Estimate) -> f64 {
        e.ci_high - e.ci_low
    }

    #[test]
    fn the_block_bootstrap_widens_on_autocorrelated_data_and_not_on_iid_data() {
        let mut rng = SplitMix64(42);
        let mut uniform = || (rng.next() >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
        let iid: Vec<f64> = (0..2000).map(|_| uniform()).collect();
        // AR(1) with φ = 0.9: the mean's variance is (1 + φ)/(1 − φ) = 19 times the iid one,
        // its standard deviation about 4.4 times.
        let mut x = 0.0;
        let ar: Vec<f64> = (0..2000)
            .map(|_| {
                x = 0.9 * x + uniform();
                x
            })
            .collect();
        let auto = OpeOptions::default();
        assert_eq!(block_length(2000, &auto), 13); // ⌈2000^{1/3}⌉ = ⌈12.6⌉
        let iid_boot = OpeOptions {
            bootstrap_block: 1,
            ..auto
        };
        let ratio = |ys: &[f64]| {
            let b = evaluate(&plain_log(ys), Estimator::Ips, &auto).unwrap();
            let i = evaluate(&plain_log(ys), Estimator::Ips, &iid_boot).unwrap();
            assert!((b.value - i.value).abs() < 1e-12);
            width(&b) / width(&i)
        };
        let on_iid = ratio(&iid);
        assert!((0.85..1.15).contains(&on_iid), "iid: {on_iid}");
        let on_ar = ratio(&ar);
        assert!(on_ar > 2.0, "AR(1): {on_ar}");
    }

    #[test]
    fn block_one_is_the_iid_bootstrap_and_blocks_never_exceed_the_log() {
        let o = OpeOptions {
            bootstrap_block: 1,
            ..OpeOptions::default()
        };
        assert_eq!(block_length(2000, &o), 1);
        assert_eq!(
            block_length(
                5,
                &OpeOptions {
                    bootstrap_block: 50,
                    ..o
                }
            ),
            5
        );
        assert_eq!(block_length(1, &OpeOptions::default()), 1);
        // A block as long as the log resamples the log itself (rotated): no spread at all.
        let ys: Vec<f64> = (0..30).map(|i| f64::from(i % 7)).collect();
        let whole = OpeOptions {
            bootstrap_block: 30,
            ..o
        };
        let e = evaluate(&plain_log(&ys), Estimator::Ips, &whole).unwrap();
        assert!(width(&e) < 1e-9, "{e:?}");
    }

    /// Two candidates; the logger sends candidate 0 a share that moves slowly between 0.2 and
    /// 0.8 (phases of 200 requests). Candidate 0 scores `base − load·(its share of the last
    /// 50 requests)` plus noise; candidate 1 scores 0.5 plus noise. The target: candidate 0
    /// with probability `to_zero`.
    fn load_log(load: f64, to_zero: f64) -> Vec<LoggedDecision> {
        let mut rng = SplitMix64(7);
        let mut u = || (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        let mut recent: Vec<usize> = Vec::new();
        (0..3000)
            .map(|i| {
                let p0 = if (i / 200) % 2 == 0 { 0.2 } else { 0.8 };
                let action = usize::from(u() >= p0);
                let share = recent.iter().rev().take(50).filter(|&&a| a == 0).count() as f64 / 50.0;
                recent.push(action);
                let noise = 0.1 * (u() - 0.5);
                let outcome = if action == 0 {
                    0.9 - load * share + noise
                } else {
                    0.5 + noise
                };
                LoggedDecision {
                    features: vec![],
                    eligible: vec![0, 1],
                    action,
                    propensity: if action == 0 { p0 } else { 1.0 - p0 },
                    propensity_exact: true,
                    target: vec![to_zero, 1.0 - to_zero],
                    outcome,
                }
            })
            .collect()
    }

    fn load_warnings_of(log: &[LoggedDecision]) -> Vec<(usize, f64, f64)> {
        evaluate(log, Estimator::Snips, &OpeOptions::default())
            .unwrap()
            .warnings
            .iter()
            .filter_map(|w| match w {
                SupportWarning::LoadDependent {
                    candidate,
                    slope,
                    shift,
                    ..
                } => Some((*candidate, *slope, *shift)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn an_outcome_that_depends_on_the_load_is_warned_when_the_target_changes_the_load() {
        // Candidate 0 loses 0.4 per unit of its share; the logger gave it 0.5 on average, the
        // target gives it everything: its outcome there would move by about
        // 1 · (−0.4) · (1 − 0.5) = −0.2.
        let ws = load_warnings_of(&load_log(0.4, 1.0));
        assert_eq!(ws.len(), 1, "{ws:?}");
        let (candidate, slope, shift) = ws[0];
        assert_eq!(candidate, 0);
        assert!((slope + 0.4).abs() < 0.05, "{slope}");
        assert!((shift + 0.2).abs() < 0.03, "{shift}");
        let e = evaluate(
            &load_log(0.4, 1.0),
            Estimator::Snips,
            &OpeOptions::default(),
        )
        .unwrap();
        let text = e.warnings.last().unwrap().to_string();
        assert!(
            text.contains("send it 100%") && text.contains("slope -0.4"),
            "{text}"
        );
        // The same outcomes without the load dependence: nothing to warn about.
        assert!(load_warnings_of(&load_log(0.0, 1.0)).is_empty());
        // Load dependence, but the target keeps the logged share: no shift, no warning.
        assert!(load_warnings_of(&load_log(0.4, 0.5)).is_empty());
        // No test with a window of 0.
        let off = OpeOptions {
            load_window: 0,
            ..OpeOptions::default()
        };
        let e = evaluate(&load_log(0.4, 1.0), Estimator::Snips, &off).unwrap();
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
    }

    #[test]
    fn a_target_that_reacts_to_the_load_is_warned_with_its_choices_under_its_own_load() {
        // Outcomes do not depend on the load (0.9 on candidate 0, 0.5 on 1), but the target
        // reads it: it picks candidate 0 with 1 − 0.6·(0's share of the last 50 requests). The
        // logger gave 0 a share of 0.5 on average, so the target's mean is about 0.7; on its
        // own traffic 0's share would be 0.7 and the target would pick it with about
        // 0.7 − 0.6·(0.7 − 0.5) = 0.58: 0.12 of the requests move from 0.9 to 0.5, a shift
        // of about −0.12·0.4 = −0.048.
        let reactive: Vec<LoggedDecision> = load_log(0.0, 1.0)
            .into_iter()
            .scan(Vec::<usize>::new(), |recent, mut r| {
                let share = recent.iter().rev().take(50).filter(|&&a| a == 0).count() as f64 / 50.0;
                recent.push(r.action);
                let to_zero = if recent.len() > 50 {
                    1.0 - 0.6 * share
                } else {
                    0.7
                };
                r.target = vec![to_zero, 1.0 - to_zero];
                Some(r)
            })
            .collect();
        let e = evaluate(&reactive, Estimator::Snips, &OpeOptions::default()).unwrap();
        let on_zero = e.warnings.iter().find_map(|w| match w {
            SupportWarning::LoadReactive {
                candidate: 0,
                slope,
                own_share,
                shift,
                ..
            } => Some((*slope, *own_share, *shift)),
            _ => None,
        });
        let (slope, own, shift) = on_zero.unwrap_or_else(|| panic!("{:?}", e.warnings));
        assert!((slope + 0.6).abs() < 0.01, "{slope}");
        assert!((own - 0.58).abs() < 0.02, "{own}");
        assert!((shift + 0.048).abs() < 0.01, "{shift}");
        let text = e.warnings[0].to_string();
        assert!(text.contains("reacts to load"), "{text}");
        // The same log, a target that does not read the load: nothing to warn about.
        let steady: Vec<LoggedDecision> = reactive
            .iter()
            .map(|r| LoggedDecision {
                target: vec![0.7, 0.3],
                ..r.clone()
            })
            .collect();
        let e = evaluate(&steady, Estimator::Snips, &OpeOptions::default()).unwrap();
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
    }

    #[test]
    fn rejection_sampling_keeps_a_request_with_the_probability_ratio() {
        // The target puts 0.3 on the logged action, logged with 0.6: kept with 0.5.
        assert!(learns_from(0.3, 0.6, 0.49));
        assert!(!learns_from(0.3, 0.6, 0.51));
        // A target that agrees more than the logger (0.9 vs 0.6) always learns from it; one
        // that never chooses the action never does.
        assert!(learns_from(0.9, 0.6, 0.999));
        assert!(!learns_from(0.0, 0.6, 0.0));
    }

    /// Share of the requests of each context learnt from by a deterministic target that
    /// always agrees with the logged choice, the logger having made it with `propensity[x]`
    /// in context `x` (the same number of requests per context, coins on a fixed grid).
    fn kept_share(propensity: [f64; 2], keep: impl Fn(f64, f64) -> bool) -> [f64; 2] {
        let n = 10_000u32;
        let mut kept = [0.0; 2];
        for i in 0..n {
            let u = (f64::from(i) + 0.5) / f64::from(n);
            for (x, p) in propensity.iter().enumerate() {
                if keep(*p, u) {
                    kept[x] += 1.0 / f64::from(n);
                }
            }
        }
        kept
    }

    #[test]
    fn rejection_sampling_with_a_constant_bound_keeps_the_targets_mix_of_contexts() {
        // The logger made the target's choice with 0.9 in context 0 and only with 0.1 in
        // context 1 (its exploration floor): the target's own traffic has as many of each.
        let tilted = [0.9, 0.1];
        let bound = rejection_bound(tilted);
        assert!((bound - 0.1).abs() < 1e-15);
        // Kept with min(1, π/propensity) = 1: all of both, but the log holds nine times as
        // many agreeing requests of context 0, so the target learns from nine of context 0
        // for one of context 1.
        let agreeing = kept_share(tilted, |p, u| learns_from(1.0, p, u));
        assert!((agreeing[0] - 1.0).abs() < 1e-9 && (agreeing[1] - 1.0).abs() < 1e-9);
        // With the bound, an agreeing request is kept with bound/propensity: 0.1/0.9 of
        // context 0 and all of context 1, i.e. 0.1·(both contexts' requests) each — the
        // target's own even mix.
        let own = kept_share(tilted, |p, u| learns_as_own(1.0, p, bound, u));
        let (mix0, mix1) = (tilted[0] * own[0], tilted[1] * own[1]);
        assert!(
            (mix0 - bound).abs() < 1e-3 && (mix1 - bound).abs() < 1e-3,
            "{own:?}"
        );
        let (tilt0, tilt1) = (tilted[0] * agreeing[0], tilted[1] * agreeing[1]);
        assert!(tilt0 / tilt1 > 8.9, "{tilt0} {tilt1}");
        // Without the effect (the same propensity in both contexts) both rules keep the mix.
        let even = [0.5, 0.5];
        let b = rejection_bound(even);
        let own = kept_share(even, |p, u| learns_as_own(1.0, p, b, u));
        let agreeing = kept_share(even, |p, u| learns_from(1.0, p, u));
        assert!((own[0] - own[1]).abs() < 1e-12 && (own[0] - 1.0).abs() < 1e-9);
        assert!((agreeing[0] - agreeing[1]).abs() < 1e-12);
        // A target that never makes the logged choice learns nothing; no propensity, no bound.
        assert!(!learns_as_own(0.0, 0.1, 0.1, 0.0));
        assert!(rejection_bound([]) == 0.0);
    }

    #[test]
    fn a_random_sample_keeps_as_many_requests_as_the_own_sample_whatever_the_target() {
        // Tilted log, bound 0.1: the random sample keeps 0.1 of every request, agreeing or
        // not; the own sample keeps 0.1 of the target's own traffic: the same expected size.
        let tilted = [0.9, 0.1];
        let bound = rejection_bound(tilted);
        let sample = kept_share(tilted, |_, u| learns_as_sample(bound, u));
        assert!((sample[0] - 0.1).abs() < 1e-3 && (sample[1] - 0.1).abs() < 1e-3);
        let own = kept_share(tilted, |p, u| learns_as_own(1.0, p, bound, u));
        // Share of all requests kept, the two contexts equally frequent: a request of
        // context x is agreeing with probability tilted[x], then kept with own[x].
        let own_size = 0.5 * (tilted[0] * own[0] + tilted[1] * own[1]);
        let sample_size = 0.5 * (sample[0] + sample[1]);
        assert!((own_size - 0.1).abs() < 1e-3, "{own_size}");
        assert!(
            (own_size - sample_size).abs() < 1e-3,
            "{own_size} {sample_size}"
        );
        // Drawn with the same u, where the target's probability of the logged choice is its
        // propensity (it is the logger), both keep exactly the same requests.
        for i in 0..1000 {
            let u = (f64::from(i) + 0.5) / 1000.0;
            for p in [0.1, 0.5, 0.9] {
                assert_eq!(learns_as_own(p, p, bound, u), learns_as_sample(bound, u));
            }
        }
    }
}
