//! Hedged requests: when the first attempt is likely to be slow, a second attempt on the next
//! candidate of the ranking starts after a delay; the first good answer wins and the other is
//! cancelled. This module decides the delay (pure, from the policy's latency beliefs) and
//! bounds how often hedges start ([`HedgeBudget`]); [`crate::executor::Execution`] carries
//! the hedge through the request, so the gateway and the laboratory drive the same loop.
//!
//! **When.** With a deadline `d`, first candidate A and hedge target B (the next in the
//! ranking), a hedge started at `t` on a request A has not answered by then saves it with
//! probability
//!
//! ```text
//! save(t) = P(A misses | A silent at t) · P(B answers within d − t)
//!         = S_A(d) / S_A(t) · (1 − f_B) · (1 − S_B(d − t))
//! ```
//!
//! (`S` the predictive survival `P(L > x)` of the risk model, `f_B` B's failure rate). The
//! [`HedgeRule::DeadlineRisk`] delay is the earliest `t` with `save(t) ≥ threshold`; none
//! when no `t` reaches it. A hedge fires on a share `S_A(t)` of the requests, so the threshold
//! is the price of a hedge in saved requests: raising it buys fewer, better hedges. Without
//! a deadline the rule hedges at A's predictive `tail_quantile`.
//! [`HedgeRule::ObservedQuantile`] is the classic fixed rule: hedge after the `quantile` of
//! A's recently observed latencies (the p95 by default), whatever the request.
//!
//! **Priced.** With the hedge budget binding, a threshold on `save(t)` spends hedges where
//! they save little. [`HedgeRule::PricedSaving`] instead gives each request the delay that
//! maximises its expected saved misses minus a price `λ` per expected hedge:
//!
//! ```text
//! gain(t) = S_A(t) · (save(t) − λ) = S_A(d) · (1 − f_B) · (1 − S_B(d − t)) − λ · S_A(t)
//! ```
//!
//! (a hedge at `t` fires on a share `S_A(t)` of the requests), and no hedge when no `t` gains.
//! This is the Lagrangian of "most saved misses at a given hedge rate": where a request's
//! best `gain` is larger, its hedge comes first. The price is set by a controller in
//! [`HedgeBudget`] so that the hedge rate tracks `target_rate`: every request lowers `ln λ`
//! by `η·target_rate`, every hedge started raises it by `η`.

use crate::error::{out_of_range, unit_interval};
use crate::estimators::shape::LatencyBelief;
use crate::{ConfigError, Millis};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// How the hedge delay is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum HedgeRule {
    /// The earliest time at which a hedge saves the request with at least `threshold`
    /// probability (see the module doc); without a deadline, A's predictive `tail_quantile`.
    DeadlineRisk {
        #[serde(default = "default_threshold")]
        threshold: f64,
        #[serde(default = "default_quantile")]
        tail_quantile: f64,
    },
    /// After A's predictive `quantile` (the risk model's belief), deadline or not.
    PredictiveQuantile {
        #[serde(default = "default_quantile")]
        quantile: f64,
    },
    /// The delay that maximises the expected saved misses minus a price per hedge, the price
    /// set so that hedges start on `target_rate` of the requests (unset: 90% of `max_rate`,
    /// so the token bucket is rarely empty when a request's best hedge comes; see the module
    /// doc); without a deadline, A's predictive `tail_quantile`. With `latency_quantile`, a
    /// request the priced rule does not hedge (no miss worth the price: a loose deadline, a
    /// steady first provider) hedges at A's predictive `latency_quantile` when that comes
    /// before its deadline: a "latency" hedge on the tail of requests without real deadline
    /// risk, paid from the same budget (the price then buys misses with what is left).
    PricedSaving {
        #[serde(default)]
        target_rate: Option<f64>,
        #[serde(default = "default_quantile")]
        tail_quantile: f64,
        #[serde(
            default = "default_latency_quantile",
            deserialize_with = "quantile_or_off",
            serialize_with = "quantile_or_false"
        )]
        latency_quantile: Option<f64>,
        #[serde(default = "default_loose_risk")]
        loose_risk: f64,
    },
    /// The classic rule: after the `quantile` of A's last observed latencies.
    ObservedQuantile {
        #[serde(default = "default_quantile")]
        quantile: f64,
    },
}

/// Chosen in the laboratory on seeds 1–5 (docs/hedging.md): the lowest deadline-miss rate
/// within 5% extra calls on the heavy-tailed scenarios (of the thresholds).
fn default_threshold() -> f64 {
    0.2
}

/// Latency hedges at A's predictive p95 on loose deadlines: chosen on seeds 1–5 (p90, p95,
/// p97; loose at 1% or 2%) and confirmed on seeds 36–65, where they cut `tail-pair`'s p99 by
/// 102 ± 31 ms with misses and extra calls unchanged within noise (docs/hedging.md).
#[allow(clippy::unnecessary_wraps)] // serde's default for an `Option` field
fn default_latency_quantile() -> Option<f64> {
    Some(0.95)
}

/// `latency_quantile = 0.9` (a quantile) or `latency_quantile = false` (no latency hedges).
fn quantile_or_off<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum QuantileOrOff {
        Off(bool),
        At(f64),
    }
    match QuantileOrOff::deserialize(d)? {
        QuantileOrOff::Off(false) => Ok(None),
        QuantileOrOff::Off(true) => Err(serde::de::Error::custom(
            "hedge.latency_quantile: `true` is not a quantile; give one in (0, 1), e.g. 0.95, or `false` for no latency hedges",
        )),
        QuantileOrOff::At(q) => Ok(Some(q)),
    }
}

/// Writes `None` as `false`, which [`quantile_or_off`] reads back (a missing field would
/// read back as the default, on).
#[allow(clippy::ref_option)] // serde's signature for an `Option` field
fn quantile_or_false<S: serde::Serializer>(q: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match q {
        Some(q) => s.serialize_f64(*q),
        None => s.serialize_bool(false),
    }
}

/// A deadline A misses with at most this probability is loose: beyond A's predictive p99.
fn default_loose_risk() -> f64 {
    0.01
}

fn default_quantile() -> f64 {
    0.95
}

/// The share of `max_rate` the priced rule aims at when `target_rate` is unset; chosen with
/// the default `max_rate` (0.05, so 4.5%) on seeds 1–5 in the laboratory (docs/hedging.md).
pub const DEFAULT_TARGET_SHARE: f64 = 0.9;

impl Default for HedgeRule {
    fn default() -> Self {
        HedgeRule::PricedSaving {
            target_rate: None,
            tail_quantile: default_quantile(),
            latency_quantile: default_latency_quantile(),
            loose_risk: default_loose_risk(),
        }
    }
}

/// Hedging settings of one interface.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HedgeConfig {
    pub enabled: bool,
    /// `{ kind = "deadline-risk", threshold = 0.2 }`, `{ kind = "observed-quantile" }`, …
    pub rule: HedgeRule,
    /// Most hedges per request over time (a token bucket earning this much per request).
    pub max_rate: f64,
    /// Hedges the bucket can save up for a burst.
    pub burst: f64,
    /// Attempts in flight at once, the first included: 2 allows one hedge (1 disables).
    pub max_parallel: u32,
    /// Whether streamed requests hedge (racing to the first byte).
    pub streams: bool,
}

impl Default for HedgeConfig {
    fn default() -> Self {
        HedgeConfig {
            enabled: false,
            rule: HedgeRule::default(),
            max_rate: 0.05,
            burst: 5.0,
            max_parallel: 2,
            streams: true,
        }
    }
}

impl HedgeConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// A field out of range, named with its fix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self.rule {
            HedgeRule::DeadlineRisk {
                threshold,
                tail_quantile,
            } => {
                open_unit("hedge.threshold", threshold)?;
                open_unit("hedge.tail_quantile", tail_quantile)?;
            }
            HedgeRule::PricedSaving {
                target_rate,
                tail_quantile,
                latency_quantile,
                loose_risk,
            } => {
                open_unit("hedge.tail_quantile", tail_quantile)?;
                if let Some(q) = latency_quantile {
                    open_unit("hedge.latency_quantile", q)?;
                }
                open_unit("hedge.loose_risk", loose_risk)?;
                let Some(target_rate) = target_rate else {
                    return self.validate_budget();
                };
                open_unit("hedge.target_rate", target_rate)?;
                if target_rate > self.max_rate {
                    return Err(out_of_range(
                        "hedge.target_rate",
                        target_rate,
                        "must be at most hedge.max_rate (the budget's hard limit): lower it or raise max_rate",
                    ));
                }
            }
            HedgeRule::PredictiveQuantile { quantile }
            | HedgeRule::ObservedQuantile { quantile } => {
                open_unit("hedge.quantile", quantile)?;
            }
        }
        self.validate_budget()
    }

    fn validate_budget(&self) -> Result<(), ConfigError> {
        unit_interval("hedge.max_rate", self.max_rate)?;
        if !(self.burst.is_finite() && self.burst >= 1.0) {
            return Err(out_of_range(
                "hedge.burst",
                self.burst,
                "must be a finite number of at least 1 (one hedge)",
            ));
        }
        if !(1..=2).contains(&self.max_parallel) {
            return Err(out_of_range(
                "hedge.max_parallel",
                self.max_parallel,
                "must be 1 (no hedge) or 2 (one hedge beside the first attempt); more is not supported",
            ));
        }
        Ok(())
    }

    /// Whether hedges may start at all.
    #[must_use]
    pub fn active(&self) -> bool {
        self.enabled && self.max_parallel >= 2 && self.max_rate > 0.0
    }
}

fn open_unit(field: &'static str, v: f64) -> Result<f64, ConfigError> {
    if v > 0.0 && v < 1.0 {
        Ok(v)
    } else {
        Err(out_of_range(field, v, "must be strictly between 0 and 1"))
    }
}

/// What a policy with a latency model believes about one candidate: latency and failure rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatencyOutlook {
    pub latency: LatencyBelief,
    pub failure_rate: f64,
}

/// The outlook a streamed request hedges on, whose race ends at the first byte: the
/// candidate's first-byte belief in place of its whole-answer latency, its failure rate kept
/// (a call that fails fails its stream too); `answer` as it is when no first-byte belief is
/// known yet. `None` without `answer`: a policy with no latency model does not hedge.
///
/// A stream's deadline bounds its first byte (the attempt's time left is its first-byte
/// limit), so [`hedge_plan`] on these outlooks asks the same question as for an answer:
/// `S_A(d)` is the chance that A's first byte misses the deadline.
#[must_use]
pub fn first_byte_outlook(
    answer: Option<&LatencyOutlook>,
    first_byte: Option<LatencyBelief>,
) -> Option<LatencyOutlook> {
    let answer = answer?;
    Some(match first_byte {
        Some(latency) => LatencyOutlook {
            latency,
            failure_rate: answer.failure_rate,
        },
        None => *answer,
    })
}

/// Time points the delay search tries, log-spaced from [`MIN_DELAY_MS`] to the deadline.
const GRID: usize = 96;
/// The earliest hedge (ms): a hedge at 0 would be a second request, not a hedge.
pub const MIN_DELAY_MS: f64 = 1.0;

/// Which part of a [`HedgeRule`] set a hedge's delay (for counting hedges by why they fire).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HedgeReason {
    /// A quantile of the first provider's latency: the quantile rules, and every rule on a
    /// request without a deadline (its `tail_quantile`).
    Quantile,
    /// [`HedgeRule::DeadlineRisk`]'s save threshold.
    DeadlineRisk,
    /// [`HedgeRule::PricedSaving`]'s price of a hedge in saved deadline misses.
    Priced,
    /// [`HedgeRule::PricedSaving`]'s latency hedge on a loose deadline (`latency_quantile`),
    /// when it comes before the priced delay.
    Latency,
}

/// When a request hedges, and why ([`hedge_plan`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HedgePlan {
    /// The delay after the first attempt's start at which the hedge starts.
    pub delay: Millis,
    /// The part of the rule that set it.
    pub reason: HedgeReason,
}

impl HedgeReason {
    /// A short lowercase name for metrics and logs.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            HedgeReason::Quantile => "quantile",
            HedgeReason::DeadlineRisk => "deadline_risk",
            HedgeReason::Priced => "priced",
            HedgeReason::Latency => "latency",
        }
    }
}

/// The delay after the first attempt's start at which the request hedges, by `rule`, and
/// which part of the rule set it, or `None` for no hedge. `first` and `target` are the
/// policy's outlooks for the first candidate and the hedge target; `observed` is the first
/// candidate's recent latencies (for the classic rule); `price` is the price of a hedge in
/// saved misses ([`HedgeBudget::price`], for [`HedgeRule::PricedSaving`]).
#[must_use]
pub fn hedge_plan(
    rule: HedgeRule,
    first: Option<&LatencyOutlook>,
    target: Option<&LatencyOutlook>,
    observed: Option<&RecentLatencies>,
    deadline: Option<Millis>,
    price: f64,
) -> Option<HedgePlan> {
    let (delay, reason) = match rule {
        HedgeRule::ObservedQuantile { quantile } => {
            (observed?.quantile(quantile)?, HedgeReason::Quantile)
        }
        HedgeRule::PredictiveQuantile { quantile } => (
            predictive_quantile(&first?.latency, quantile)?,
            HedgeReason::Quantile,
        ),
        HedgeRule::DeadlineRisk {
            threshold,
            tail_quantile,
        } => match deadline {
            None => (
                predictive_quantile(&first?.latency, tail_quantile)?,
                HedgeReason::Quantile,
            ),
            Some(d) => (
                risk_delay(first?, target?, d.0, threshold)?,
                HedgeReason::DeadlineRisk,
            ),
        },
        HedgeRule::PricedSaving {
            tail_quantile,
            latency_quantile,
            loose_risk,
            ..
        } => match deadline {
            None => (
                predictive_quantile(&first?.latency, tail_quantile)?,
                HedgeReason::Quantile,
            ),
            Some(d) => {
                let (first, target) = (first?, target?);
                let priced = priced_delay(first, target, d.0, price);
                // A loose deadline: the tail, not the deadline, makes this request's p99.
                let latency = latency_quantile
                    .filter(|_| first.latency.exceedance(d.0) <= loose_risk)
                    .and_then(|q| latency_hedge(first, target, q));
                match (priced, latency) {
                    (Some(p), Some(l)) if l < p => (l, HedgeReason::Latency),
                    (Some(p), _) => (p, HedgeReason::Priced),
                    (None, l) => (l?, HedgeReason::Latency),
                }
            }
        },
    };
    // Past the deadline a hedge has no time left to answer in.
    if deadline.is_some_and(|d| delay >= d.0) {
        return None;
    }
    Some(HedgePlan {
        delay: Millis(delay.max(MIN_DELAY_MS)),
        reason,
    })
}

/// A latency hedge at A's predictive `quantile`, when it is more likely than not to cut the
/// wait: B's median answer after it comes before A's median given A is silent then (its
/// `(1 + quantile)/2` quantile). A steady first provider, whose tail past the quantile is
/// short, is not hedged for latency: the hedge would rarely win and only spend the budget.
fn latency_hedge(first: &LatencyOutlook, target: &LatencyOutlook, quantile: f64) -> Option<f64> {
    let at = predictive_quantile(&first.latency, quantile)?;
    let silent_median = predictive_quantile(&first.latency, 0.5 * (1.0 + quantile))?;
    let hedge_median = predictive_quantile(&target.latency, 0.5)?;
    (at + hedge_median < silent_median).then_some(at)
}

/// `save(t)` of the module doc.
#[must_use]
pub fn save_probability(
    first: &LatencyOutlook,
    target: &LatencyOutlook,
    deadline_ms: f64,
    t_ms: f64,
) -> f64 {
    let silent = first.latency.exceedance(t_ms);
    if silent <= 0.0 {
        return 0.0;
    }
    let miss = (first.latency.exceedance(deadline_ms) / silent).min(1.0);
    let answers =
        (1.0 - target.failure_rate) * (1.0 - target.latency.exceedance(deadline_ms - t_ms));
    miss * answers
}

/// The earliest `t < d` with `save(t) ≥ threshold`: the first of a log-spaced grid of
/// points, then bisected against the point before it.
fn risk_delay(
    first: &LatencyOutlook,
    target: &LatencyOutlook,
    deadline_ms: f64,
    threshold: f64,
) -> Option<f64> {
    if deadline_ms <= MIN_DELAY_MS || first.latency.exceedance(deadline_ms) <= 0.0 {
        return None;
    }
    let (lo, hi) = (MIN_DELAY_MS.ln(), deadline_ms.ln());
    let at = |k: usize| lo + (hi - lo) * k as f64 / GRID as f64;
    let saves = |y: f64| save_probability(first, target, deadline_ms, y.exp()) >= threshold;
    let k = (0..GRID).find(|&k| saves(at(k)))?;
    if k == 0 {
        return Some(MIN_DELAY_MS);
    }
    // The crossing lies between the grid point before and this one: bisect it.
    let (mut below, mut above) = (at(k - 1), at(k));
    for _ in 0..30 {
        let mid = f64::midpoint(below, above);
        if saves(mid) {
            above = mid;
        } else {
            below = mid;
        }
    }
    Some(above.exp())
}

/// `gain(t)` of the module doc: expected saved misses of a hedge at `t` minus `price` per
/// expected hedge, per request.
#[must_use]
pub fn hedge_gain(
    first: &LatencyOutlook,
    target: &LatencyOutlook,
    deadline_ms: f64,
    t_ms: f64,
    price: f64,
) -> f64 {
    let silent = first.latency.exceedance(t_ms);
    // P(A silent at t and misses) is S_A(d), at most S_A(t) (a belief's rounding aside).
    let misses = first.latency.exceedance(deadline_ms).min(silent);
    let answers =
        (1.0 - target.failure_rate) * (1.0 - target.latency.exceedance(deadline_ms - t_ms));
    misses * answers - price * silent
}

/// The `t < d` that maximises [`hedge_gain`], when its gain is positive: the best of a
/// log-spaced grid, refined by a golden-section search between its neighbours.
fn priced_delay(
    first: &LatencyOutlook,
    target: &LatencyOutlook,
    deadline_ms: f64,
    price: f64,
) -> Option<f64> {
    if deadline_ms <= MIN_DELAY_MS || first.latency.exceedance(deadline_ms) <= 0.0 {
        return None;
    }
    let (lo, hi) = (MIN_DELAY_MS.ln(), deadline_ms.ln());
    let at = |k: usize| lo + (hi - lo) * k as f64 / GRID as f64;
    let gain = |y: f64| hedge_gain(first, target, deadline_ms, y.exp(), price);
    let (best, best_gain) = (0..GRID)
        .map(|k| (k, gain(at(k))))
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    if best_gain <= 0.0 {
        return None;
    }
    // Golden-section search on [at(k − 1), at(k + 1)], keeping the best point seen.
    let (mut a, mut b) = (at(best.saturating_sub(1)), at((best + 1).min(GRID - 1)));
    let (mut y, mut g) = (at(best), best_gain);
    let r = 0.5 * (5f64.sqrt() - 1.0);
    for _ in 0..30 {
        let (c, d) = (b - r * (b - a), a + r * (b - a));
        let (gc, gd) = (gain(c), gain(d));
        if gc >= gd {
            b = d;
        } else {
            a = c;
        }
        for (p, gp) in [(c, gc), (d, gd)] {
            if gp > g {
                (y, g) = (p, gp);
            }
        }
    }
    Some(y.exp())
}

/// The `q` quantile of a latency belief: the `x` with `P(L > x) = 1 − q`, by bisection on
/// `ln x` (the survival is monotone); `None` when it lies beyond 10⁷ ms.
#[must_use]
pub fn predictive_quantile(belief: &LatencyBelief, q: f64) -> Option<f64> {
    let target = 1.0 - q;
    let (mut lo, mut hi) = (1e-3f64.ln(), 1e7f64.ln());
    if belief.exceedance(hi.exp()) > target {
        return None;
    }
    for _ in 0..60 {
        let mid = f64::midpoint(lo, hi);
        if belief.exceedance(mid.exp()) > target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Some(hi.exp())
}

/// A token bucket on hedges: every request earns `max_rate` of a hedge, a hedge spends one,
/// at most `burst` saved. Over `n` requests at most `max_rate·n + burst` hedges start.
///
/// It also keeps the price of a hedge for [`HedgeRule::PricedSaving`]: a controller on
/// `ln λ` that every request lowers by `η·target_rate` and every hedge raises by `η`, so it
/// settles where hedges start on `target_rate` of the requests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HedgeBudget {
    tokens: f64,
    max_rate: f64,
    burst: f64,
    price: f64,
    target_rate: f64,
}

impl HedgeBudget {
    /// The price a new budget starts at, in saved misses per hedge.
    pub const INITIAL_PRICE: f64 = 0.2;
    /// The controller's step `η` on `ln λ`.
    pub const PRICE_STEP: f64 = 0.1;
    /// The range the price is kept in (a long quiet spell must not make hedges free).
    pub const PRICE_RANGE: (f64, f64) = (1e-3, 1.0);

    /// A full bucket for `cfg`.
    #[must_use]
    pub fn new(cfg: &HedgeConfig) -> HedgeBudget {
        let target_rate = match cfg.rule {
            HedgeRule::PricedSaving {
                target_rate: Some(rate),
                ..
            } => rate,
            _ => DEFAULT_TARGET_SHARE * cfg.max_rate,
        };
        HedgeBudget {
            tokens: cfg.burst,
            max_rate: cfg.max_rate,
            burst: cfg.burst,
            price: Self::INITIAL_PRICE,
            target_rate,
        }
    }

    /// The current price of a hedge in saved misses (see [`HedgeRule::PricedSaving`]).
    #[must_use]
    pub fn price(&self) -> f64 {
        self.price
    }

    fn move_price(&mut self, log_step: f64) {
        let (lo, hi) = Self::PRICE_RANGE;
        self.price = (self.price * log_step.exp()).clamp(lo, hi);
    }

    /// One request arrived.
    pub fn earn(&mut self) {
        self.tokens = (self.tokens + self.max_rate).min(self.burst);
        self.move_price(-Self::PRICE_STEP * self.target_rate);
    }

    /// Whether a hedge is left (without taking it).
    #[must_use]
    pub fn has_hedge(&self) -> bool {
        self.tokens >= 1.0 - 1e-9
    }

    /// Takes a hedge if one is left.
    pub fn try_spend(&mut self) -> bool {
        // A whole token, up to the rounding of twenty 0.05s.
        if self.has_hedge() {
            self.tokens -= 1.0;
            self.move_price(Self::PRICE_STEP);
            true
        } else {
            false
        }
    }
}

/// The last latencies of one candidate's answers, for the classic observed-quantile rule.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecentLatencies {
    window: VecDeque<f64>,
}

impl RecentLatencies {
    /// Latencies kept.
    pub const WINDOW: usize = 256;
    /// Fewer observations than this give no quantile.
    pub const MIN_OBSERVATIONS: usize = 20;

    /// Adds the latency of an answer.
    pub fn push(&mut self, latency_ms: f64) {
        if self.window.len() == Self::WINDOW {
            self.window.pop_front();
        }
        self.window.push_back(latency_ms);
    }

    /// The `q` quantile (nearest rank) of the window, once it holds enough observations.
    #[must_use]
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.window.len() < Self::MIN_OBSERVATIONS {
            return None;
        }
        let mut sorted: Vec<f64> = self.window.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
        Some(sorted[rank - 1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimators::nig::NigPosterior;

    /// A log-normal belief with median `median_ms` and log-sd `sigma`, known exactly (huge
    /// pseudo-counts: the Student-t is a Normal).
    fn lognormal(median_ms: f64, sigma: f64) -> LatencyBelief {
        let alpha = 1e9;
        LatencyBelief::log_normal(NigPosterior {
            mu_n: median_ms.ln(),
            kappa_n: 1e9,
            alpha_n: alpha,
            beta_n: sigma * sigma * alpha,
        })
    }

    fn outlook(median_ms: f64, sigma: f64, failure_rate: f64) -> LatencyOutlook {
        LatencyOutlook {
            latency: lognormal(median_ms, sigma),
            failure_rate,
        }
    }

    #[test]
    fn the_predictive_quantile_inverts_the_survival() {
        // Median 300 ms, σ = 0.5: the 95% quantile is 300·e^(1.6449·0.5) = 682.8 ms.
        let q = predictive_quantile(&lognormal(300.0, 0.5), 0.95).unwrap();
        assert!((q - 682.8).abs() < 0.5, "{q}");
        let half = predictive_quantile(&lognormal(300.0, 0.5), 0.5).unwrap();
        assert!((half - 300.0).abs() < 0.1, "{half}");
    }

    #[test]
    fn the_risk_delay_is_the_earliest_time_a_hedge_saves_the_request_often_enough() {
        // A: median 300 ms, σ = 1 (heavy): S_A(2000) = P(Z > ln(2000/300)) = P(Z > 1.897)
        // = 0.0289. B: median 500, σ = 0.3, no failures.
        let (a, b) = (outlook(300.0, 1.0, 0.0), outlook(500.0, 0.3, 0.0));
        // At t = 1000: S_A(1000) = P(Z > 1.204) = 0.1143, so P(miss | silent) = 0.253;
        // B has 1000 ms: P(L_B ≤ 1000) = Φ(ln 2/0.3 = 2.310) = 0.9896. save = 0.250.
        let s = save_probability(&a, &b, 2000.0, 1000.0);
        assert!((s - 0.250).abs() < 0.003, "{s}");
        let rule = HedgeRule::DeadlineRisk {
            threshold: 0.25,
            tail_quantile: 0.95,
        };
        let d = hedge_plan(rule, Some(&a), Some(&b), None, Some(Millis(2000.0)), 0.0)
            .map(|p| p.delay)
            .unwrap();
        // save(990) = 0.2487·0.9899 = 0.246: the crossing lies just below 1000 ms.
        assert!(d.0 > 990.0 && d.0 <= 1000.0, "{d:?}");
        assert!(save_probability(&a, &b, 2000.0, d.0) >= 0.25);
        // A target that fails half the time halves every save: 0.25 is out of reach (the
        // best, near t = 1350, is 0.436·0.809·0.5 = 0.18).
        let flaky = outlook(500.0, 0.3, 0.5);
        assert_eq!(
            hedge_plan(
                rule,
                Some(&a),
                Some(&flaky),
                None,
                Some(Millis(2000.0)),
                0.0
            )
            .map(|p| p.delay),
            None
        );
        // No deadline: the tail quantile, 300·e^1.6449 = 1553 ms.
        let d = hedge_plan(rule, Some(&a), Some(&b), None, None, 0.0)
            .map(|p| p.delay)
            .unwrap();
        assert!((d.0 - 1553.0).abs() < 2.0, "{d:?}");
        // A policy without a latency model gives no outlook: no hedge.
        assert_eq!(
            hedge_plan(rule, None, None, None, Some(Millis(2000.0)), 0.0).map(|p| p.delay),
            None
        );
    }

    #[test]
    fn the_priced_gain_is_saved_misses_minus_the_price_of_the_hedges() {
        // The example above at t = 1000, price 0.1: S_A(2000)·(1 − S_B(1000)) − 0.1·S_A(1000)
        // = 0.0289·0.9896 − 0.1·0.1143 = 0.0286 − 0.0114 = 0.0172.
        let (a, b) = (outlook(300.0, 1.0, 0.0), outlook(500.0, 0.3, 0.0));
        let g = hedge_gain(&a, &b, 2000.0, 1000.0, 0.1);
        assert!((g - 0.0172).abs() < 3e-4, "{g}");
        // The priced delay is the gain's maximum: no better a little earlier or later.
        let rule = HedgeRule::PricedSaving {
            target_rate: Some(0.045),
            tail_quantile: 0.95,
            latency_quantile: None,
            loose_risk: 0.01,
        };
        let d = hedge_plan(rule, Some(&a), Some(&b), None, Some(Millis(2000.0)), 0.1)
            .map(|p| p.delay)
            .unwrap();
        let best = hedge_gain(&a, &b, 2000.0, d.0, 0.1);
        assert!(best > 0.0);
        for t in [d.0 / 1.05, d.0 * 1.05] {
            assert!(hedge_gain(&a, &b, 2000.0, t, 0.1) <= best, "{t} vs {d:?}");
        }
        // A dearer hedge comes later (it must save more per hedge fired), a dear enough one
        // never (max over t of S_A(d)·P_B − λ·S_A(t) < 0 once λ > S_A(d)/S_A(t)·P_B for all t).
        let later = hedge_plan(rule, Some(&a), Some(&b), None, Some(Millis(2000.0)), 0.2)
            .map(|p| p.delay)
            .unwrap();
        assert!(later.0 > d.0, "{later:?} vs {d:?}");
        assert_eq!(
            hedge_plan(rule, Some(&a), Some(&b), None, Some(Millis(2000.0)), 0.9).map(|p| p.delay),
            None
        );
    }

    #[test]
    fn at_one_price_the_rule_hedges_a_request_with_a_large_saving_and_not_one_with_none() {
        let b = outlook(500.0, 0.3, 0.0);
        let rule = HedgeRule::PricedSaving {
            target_rate: Some(0.045),
            tail_quantile: 0.95,
            latency_quantile: None,
            loose_risk: 0.01,
        };
        let deadline = Some(Millis(2000.0));
        // Heavy A: 2.9% of its calls miss 2000 ms, and B nearly always saves them.
        let heavy = outlook(300.0, 1.0, 0.0);
        assert!(
            hedge_plan(rule, Some(&heavy), Some(&b), None, deadline, 0.1)
                .map(|p| p.delay)
                .is_some()
        );
        // Steady A (median 300, σ = 0.2): S_A(2000) = P(Z > 9.5) ≈ 1e-21, nothing to save.
        let steady = outlook(300.0, 0.2, 0.0);
        assert_eq!(
            hedge_plan(rule, Some(&steady), Some(&b), None, deadline, 0.1).map(|p| p.delay),
            None
        );
        // A target that cannot answer in time saves nothing either (median 5 s).
        let slow = outlook(5000.0, 0.3, 0.0);
        assert_eq!(
            hedge_plan(rule, Some(&heavy), Some(&slow), None, deadline, 0.1).map(|p| p.delay),
            None
        );
        // Without a deadline, the tail quantile (300·e^1.6449 = 1553 ms), whatever the price.
        let d = hedge_plan(rule, Some(&heavy), Some(&b), None, None, 0.9)
            .map(|p| p.delay)
            .unwrap();
        assert!((d.0 - 1553.0).abs() < 2.0, "{d:?}");
    }

    #[test]
    fn a_loose_deadline_gets_a_latency_hedge_at_the_quantile_when_the_hedge_would_win() {
        // A: median 250 ms, σ = 1: S_A(4000) = P(Z > ln 16 = 2.773) = 0.0028, below 1%: the
        // 4000 ms deadline is loose. B: median 350 ms, σ = 0.3.
        let (a, b) = (outlook(250.0, 1.0, 0.0), outlook(350.0, 0.3, 0.0));
        let rule = |latency_quantile| HedgeRule::PricedSaving {
            target_rate: Some(0.045),
            tail_quantile: 0.95,
            latency_quantile,
            loose_risk: 0.01,
        };
        let loose = Some(Millis(4000.0));
        // A price so high that no miss is worth a hedge: the priced rule alone does not hedge.
        assert_eq!(
            hedge_plan(rule(None), Some(&a), Some(&b), None, loose, 0.9).map(|p| p.delay),
            None
        );
        // With latency hedges at the p95: 250·e^1.6449 = 1295 ms, and B's median after it
        // (1295 + 350 = 1645 ms) comes before A's median given silence then (its p97.5,
        // 250·e^1.96 = 1774 ms).
        let d = hedge_plan(rule(Some(0.95)), Some(&a), Some(&b), None, loose, 0.9)
            .map(|p| p.delay)
            .unwrap();
        assert!((d.0 - 1295.0).abs() < 2.0, "{d:?}");
        // At a price where the priced rule hedges (late, just in time for B), the earlier wins.
        let priced = hedge_plan(rule(None), Some(&a), Some(&b), None, loose, 0.01)
            .map(|p| p.delay)
            .unwrap();
        assert!(priced.0 > 1295.0, "{priced:?}");
        let both = hedge_plan(rule(Some(0.95)), Some(&a), Some(&b), None, loose, 0.01)
            .map(|p| p.delay)
            .unwrap();
        assert!((both.0 - 1295.0).abs() < 2.0, "{both:?}");
        // A tight deadline is not loose: S_A(1500) = P(Z > 1.792) = 0.037 > 1%, priced only.
        let tight = Some(Millis(1500.0));
        assert_eq!(
            hedge_plan(rule(Some(0.95)), Some(&a), Some(&b), None, tight, 0.9).map(|p| p.delay),
            None
        );
        // A steady A (median 700, σ = 0.33): its p95 is 1205 ms, its p97.5 1337 ms, and B's
        // median after its p95 (1555 ms) comes later: the hedge would rarely win, none.
        let steady = outlook(700.0, 0.33, 0.0);
        assert_eq!(
            hedge_plan(rule(Some(0.95)), Some(&steady), Some(&b), None, loose, 0.9)
                .map(|p| p.delay),
            None
        );
        // Which part set each delay: the latency hedge when it comes first (alone, or before
        // the priced delay), the priced delay when only it hedges, and without a deadline
        // the tail quantile (A's p95, 1295 ms).
        let reason = |latency_quantile, deadline, price| {
            hedge_plan(
                rule(latency_quantile),
                Some(&a),
                Some(&b),
                None,
                deadline,
                price,
            )
            .map(|p| p.reason)
        };
        assert_eq!(reason(Some(0.95), loose, 0.9), Some(HedgeReason::Latency));
        assert_eq!(reason(Some(0.95), loose, 0.01), Some(HedgeReason::Latency));
        assert_eq!(reason(None, loose, 0.01), Some(HedgeReason::Priced));
        assert_eq!(reason(Some(0.95), None, 0.9), Some(HedgeReason::Quantile));
        assert_eq!(
            [
                HedgeReason::Quantile,
                HedgeReason::DeadlineRisk,
                HedgeReason::Priced,
                HedgeReason::Latency
            ]
            .map(HedgeReason::as_str),
            ["quantile", "deadline_risk", "priced", "latency"]
        );
    }

    #[test]
    fn the_price_controller_keeps_the_hedge_rate_near_its_target() {
        use rand::SeedableRng;
        use rand_distr::Distribution;
        // Requests whose first provider is heavy (median 300, σ = 1), deadline 2000 ms, the
        // target steady: the hedge fires when A's drawn latency outlasts the delay.
        let (a, b) = (outlook(300.0, 1.0, 0.0), outlook(500.0, 0.3, 0.0));
        let cfg = HedgeConfig {
            enabled: true,
            rule: HedgeRule::PricedSaving {
                target_rate: Some(0.03),
                tail_quantile: 0.95,
                latency_quantile: None,
                loose_risk: 0.01,
            },
            ..HedgeConfig::default()
        };
        let mut budget = HedgeBudget::new(&cfg);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let normal = rand_distr::Normal::new(300f64.ln(), 1.0).unwrap();
        let (n, mut hedges) = (20_000, 0);
        for _ in 0..n {
            let delay = hedge_plan(
                cfg.rule,
                Some(&a),
                Some(&b),
                None,
                Some(Millis(2000.0)),
                budget.price(),
            )
            .map(|p| p.delay);
            budget.earn();
            let latency = normal.sample(&mut rng).exp();
            if delay.is_some_and(|d| latency > d.0) && budget.try_spend() {
                hedges += 1;
            }
        }
        // The budget (5% + burst) would allow 1005; the controller holds the rate at 3%.
        let rate = f64::from(hedges) / f64::from(n);
        assert!((rate - 0.03).abs() < 0.003, "{rate}");
        // No one delay fires on 3% here (A's p97 is 1968 ms, where B has no time left): the
        // best hedge is earlier and fires more often, so the price swings between "hedge
        // then" and "not at all" and the rate averages to the target; it stays inside its range.
        let (lo, hi) = HedgeBudget::PRICE_RANGE;
        assert!(
            budget.price() > lo && budget.price() < hi,
            "{}",
            budget.price()
        );
    }

    #[test]
    fn the_classic_rule_hedges_after_the_observed_quantile() {
        let mut recent = RecentLatencies::default();
        let rule = HedgeRule::ObservedQuantile { quantile: 0.95 };
        for ms in 1..=19 {
            recent.push(f64::from(ms) * 10.0);
        }
        assert_eq!(
            hedge_plan(rule, None, None, Some(&recent), None, 0.0).map(|p| p.delay),
            None
        );
        recent.push(200.0);
        // 20 answers 10..200 ms: the 95% nearest rank is the 19th, 190 ms.
        assert_eq!(
            hedge_plan(rule, None, None, Some(&recent), None, 0.0).map(|p| p.delay),
            Some(Millis(190.0))
        );
        // Past the deadline it would be pointless.
        assert_eq!(
            hedge_plan(rule, None, None, Some(&recent), Some(Millis(150.0)), 0.0).map(|p| p.delay),
            None
        );
        for _ in 0..RecentLatencies::WINDOW {
            recent.push(5.0);
        }
        assert_eq!(recent.quantile(0.95), Some(5.0), "the window forgets");
    }

    #[test]
    fn the_budget_allows_max_rate_per_request_plus_the_burst() {
        let cfg = HedgeConfig {
            enabled: true,
            max_rate: 0.05,
            burst: 2.0,
            ..HedgeConfig::default()
        };
        let mut budget = HedgeBudget::new(&cfg);
        let mut hedges = 0;
        for _ in 0..1000 {
            budget.earn();
            if budget.try_spend() {
                hedges += 1;
            }
        }
        // Every request wants one: the 2 saved go at requests 1 and 2, then one every 20
        // requests (21, 41, …, 981): 2 + 49, within 0.05·1000 + 2.
        assert_eq!(hedges, 51);
    }

    #[test]
    fn latency_hedges_are_on_by_default_and_false_turns_them_off() {
        let rule = |text: &str| serde_json::from_str::<HedgeRule>(text);
        let latency = |r: HedgeRule| match r {
            HedgeRule::PricedSaving {
                latency_quantile, ..
            } => latency_quantile,
            other => panic!("not the priced rule: {other:?}"),
        };
        assert_eq!(latency(HedgeRule::default()), Some(0.95));
        assert_eq!(
            latency(rule(r#"{"kind": "priced-saving"}"#).unwrap()),
            Some(0.95)
        );
        let off = rule(r#"{"kind": "priced-saving", "latency_quantile": false}"#).unwrap();
        assert_eq!(latency(off), None);
        let at = rule(r#"{"kind": "priced-saving", "latency_quantile": 0.9}"#).unwrap();
        assert_eq!(latency(at), Some(0.9));
        // Written back, "off" stays off (a missing field would read back as on).
        let text = serde_json::to_string(&off).unwrap();
        assert!(text.contains(r#""latency_quantile":false"#), "{text}");
        assert_eq!(rule(&text).unwrap(), off);
        assert_eq!(rule(&serde_json::to_string(&at).unwrap()).unwrap(), at);
        let err = rule(r#"{"kind": "priced-saving", "latency_quantile": true}"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("latency_quantile") && err.contains("false"),
            "{err}"
        );
    }

    #[test]
    fn settings_out_of_range_name_the_field() {
        let bad = [
            (
                HedgeConfig {
                    max_parallel: 3,
                    ..HedgeConfig::default()
                },
                "hedge.max_parallel",
            ),
            (
                HedgeConfig {
                    max_rate: 1.5,
                    ..HedgeConfig::default()
                },
                "hedge.max_rate",
            ),
            (
                HedgeConfig {
                    rule: HedgeRule::PricedSaving {
                        target_rate: None,
                        tail_quantile: 0.95,
                        latency_quantile: Some(1.0),
                        loose_risk: 0.01,
                    },
                    ..HedgeConfig::default()
                },
                "hedge.latency_quantile",
            ),
            (
                HedgeConfig {
                    rule: HedgeRule::PricedSaving {
                        target_rate: None,
                        tail_quantile: 0.95,
                        latency_quantile: Some(0.95),
                        loose_risk: 0.0,
                    },
                    ..HedgeConfig::default()
                },
                "hedge.loose_risk",
            ),
            (
                HedgeConfig {
                    rule: HedgeRule::ObservedQuantile { quantile: 1.0 },
                    ..HedgeConfig::default()
                },
                "hedge.quantile",
            ),
            (
                HedgeConfig {
                    rule: HedgeRule::PricedSaving {
                        target_rate: Some(0.08),
                        tail_quantile: 0.95,
                        latency_quantile: None,
                        loose_risk: 0.01,
                    },
                    ..HedgeConfig::default()
                },
                "hedge.target_rate",
            ),
        ];
        for (cfg, field) in bad {
            let e = cfg.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
        assert!(HedgeConfig::default().validate().is_ok());
        // An unset target follows the budget: a lower max_rate alone is no error.
        let low = HedgeConfig {
            max_rate: 0.01,
            ..HedgeConfig::default()
        };
        assert!(low.validate().is_ok());
        assert!(!HedgeConfig::default().active(), "off unless enabled");
    }

    #[test]
    fn a_stream_hedges_on_the_first_byte_belief_when_there_is_one() {
        // A's first byte: median 30 ms, σ = 0.25; its whole streamed answer: median 1500 ms,
        // σ = 0.25; 5% of its calls fail.
        let answer = outlook(1500.0, 0.25, 0.05);
        let first_byte = lognormal(30.0, 0.25);
        let stream = first_byte_outlook(Some(&answer), Some(first_byte)).unwrap();
        assert_eq!(stream.latency, first_byte);
        assert!(
            (stream.failure_rate - 0.05).abs() < 1e-12,
            "the failure rate is kept"
        );
        let rule = HedgeRule::default();
        // No deadline: the tail quantile of the first byte, 30·e^(1.6449·0.25) = 45.3 ms,
        // where the answer's is 1500·e^(1.6449·0.25) = 2266 ms.
        let d = hedge_plan(rule, Some(&stream), None, None, None, 0.2)
            .map(|p| p.delay)
            .unwrap();
        assert!((d.0 - 45.3).abs() < 0.2, "{d:?}");
        let whole = hedge_plan(rule, Some(&answer), None, None, None, 0.2)
            .map(|p| p.delay)
            .unwrap();
        assert!((whole.0 - 2266.0).abs() < 5.0, "{whole:?}");
        // With a deadline the priced rule asks whether the first byte misses it: a heavy first
        // byte (median 300 ms, σ = 1) against a 2000 ms deadline hedges, before the deadline;
        // a first byte that cannot miss it (30 ms, σ = 0.25: S(2000) ≈ 0) does not.
        let b = outlook(500.0, 0.3, 0.0);
        let heavy = first_byte_outlook(Some(&answer), Some(lognormal(300.0, 1.0))).unwrap();
        let deadline = Some(Millis(2000.0));
        let d = hedge_plan(rule, Some(&heavy), Some(&b), None, deadline, 0.1)
            .map(|p| p.delay)
            .unwrap();
        assert!(d.0 < 2000.0, "{d:?}");
        assert_eq!(
            hedge_plan(rule, Some(&stream), Some(&b), None, deadline, 0.1).map(|p| p.delay),
            None
        );
        // No first-byte belief yet: the whole answer's outlook, unchanged; no policy belief: none.
        assert_eq!(first_byte_outlook(Some(&answer), None), Some(answer));
        assert_eq!(first_byte_outlook(None, Some(first_byte)), None);
    }
}
