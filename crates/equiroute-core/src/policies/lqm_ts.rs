//! `lqm-ts`: our policy. One decision over contextual quality, latency, deadline risk and
//! cost, which neither reference makes alone.
//!
//! **Objective.** Quality first, then risk and spend:
//!
//! ```text
//! q_i = û_i/(1 + max(0, τ̂_i − L_ref)/L_ref) + α·sqrt(xᵀA_i⁻¹x)/(1 + λΔ_i)   (`over-budget`)
//! V_i = q_i · (1 − P̃(bad)_i)          expected good quality, with LinUCB's optimism
//! V̄_i = (q_i − bonus_i) · (1 − P̃(bad)_i)   the same without the optimism: the estimate
//! g_i = (1 − P̃(bad)_i) / (1 + cost_i/C_ref)     good outcomes per unit of spend (ts-deadline)
//! ```
//!
//! The candidates whose *estimate* `V̄` is within `quality_tolerance` (default 2%) of the best
//! estimate form the *top group*, ranked by expected cost (then by the operator's `preference`, then by `V`): among answers that
//! are as good and as likely to arrive in time, the cheapest goes first. Optimism does not
//! buy a place in it — a cheap, little-tried candidate whose wide confidence interval reaches
//! the best would otherwise win on price every time, which is exploring at the user's expense.
//! If the optimistic leader (best `V`) is outside the top group, LinUCB explores it: it goes
//! first, the top group after it. Everyone else follows by `V`, and candidates held back by
//! the exploration guard come last. `P̃(bad)` is a Thompson draw from the failure EWMA and the
//! sliced log-latency posterior for *this request's* deadline (exploration of risk), the
//! posterior's location shifted by the fast latency [`super::risk::Level`] so that load shows
//! within a few calls. `τ̂` is LQM's latency EMA, read faded toward `τ₀` as the candidate's
//! risk belief goes stale (`risk.stale_half_life_ms`), so that a spike's estimate does not
//! keep a provider the ranking left discounted for good.
//!
//! **A bad-outcome budget** (`objective = { kind = "risk-budget", max_bad = B }`, off by
//! default): the reference's objective, the cheapest candidate whose risk is acceptable,
//! inside the quality tolerance. The top group is then judged on quality alone
//! (`q_i − bonus_i`, the risk being the budget's), and ordered as `ts-deadline`'s
//! `risk-budget` orders everyone: the candidates whose *sampled* `P̃(bad)` is at most `B` by
//! cost, then the others by `P̃(bad)`. Judged on the draw, a tier the ranking stopped using is
//! still first whenever its draw falls within the budget, and the stale-belief widening
//! (`risk.stale_half_life_ms`) makes that more likely the longer it goes untried, so it is
//! re-tested at a bounded rate instead of never (a point estimate kept it out for good).
//!
//! Latency below `L_ref` is free by default (`latency = "over-budget"`): the budget is spent
//! on quality and the deadline is left to `P̃(bad)`; `latency = "renewal"` is LQM's
//! `û/(1+τ̂/L_ref)`, where every millisecond costs.
//!
//! Neither speed nor cheapness can compensate for poor answers: speed only enters through the
//! latency discount of `q` and the deadline risk, and cost only orders candidates whose
//! estimated good quality is already within the tolerance of the best. A free, instant,
//! never-failing candidate with useless answers has `V̄ ≈ 0` and is never in the top group
//! while a useful one exists.
//!
//! **Defaults that differ from the references'**, each measured in the laboratory
//! (docs/policies.md, "Choosing lqm-ts's defaults"): `α_ucb = 0.2` and a warm-up of 10 quality scores per
//! candidate (LQM: 0.5 and 3) — less optimism once every candidate has been scored ten times,
//! so a candidate shrunk by the ridge after three scores is not locked out; a candidate whose
//! scores are clearly below the best candidate's leaves the warm-up early
//! (`head.warmup_exit_z = 3`, LQM: off); the fast level (`risk.level_beta = 0.3`, moving the
//! location only by what clears one standard error of its noise, `risk.level_z = 1`; off in
//! `ts-deadline`); a slower latency EMA (`lqm.ema_beta = 0.03`, LQM: 0.1): the EMA's own
//! noise crossing `L_ref` discounted a heavy-tailed provider below a worse one (the fast
//! level and the deadline risk answer load within a few calls); the context gate
//! (`head.gate = true`, LQM: off): the heads rank on context-free means until the scores
//! bear out the deviations the query predicts, except between candidates not yet told
//! apart from the leader (`head.gate_tie_z = 2`), which the query splits, so that the
//! contextual heads' noise neither explores a clearly worse provider query by query nor,
//! removed, herds the traffic of two near-tied ones.
//!
//! **Quality that changes** (`shift`, `retest`; docs/policies.md, "Quality that changes"):
//! a two-sided CUSUM on each candidate's quality residuals ([`crate::estimators::shift`])
//! discards a shifted candidate's evidence from before the change and gives it a fresh
//! warm-up; a level lost in a detected drop is re-tested with probability
//! `retest × (1 − 2^(−age/h))` per request (`age` since its last attempt, `h` the stale
//! half-life the latency and failure beliefs fade with: one clock), while that level would be
//! within the top group's tolerance. Without a detected drop nothing is drawn, so a world
//! whose quality does not change is ranked as before, draw for draw.
//!
//! **Degenerate cases** (tested):
//! - no deadline, equal costs, no failures, `latency = "renewal"` and LQM's parameters:
//!   `P̃(bad) = 0` and `g` is the same for everyone, so the ranking is exactly
//!   LQM-ContextRoute's;
//! - no quality feedback yet: the ranking is exactly `ts-deadline`'s with the `cost-per-good`
//!   objective, from the same random draws (quality cannot order what it has not seen).
//!
//! Failures are learnt by the risk model only (not as quality 0, which would count them twice).

use super::lqm::{LatencyTerm, LqmConfig, LqmState};
use super::risk::{CostObjective, RiskConfig, RiskModel, RiskState};
use super::ts_deadline::sample_scores;
use super::{
    wrong_policy, AttemptObservation, FirstChoice, Policy, PolicyKind, PolicyState, Propensity,
    QualityObservation, QualityShift, RankContext, Ranking, ScoredCandidate, MAX_PENDING_SHIFTS,
};
use crate::estimators::linucb::{LinUcbConfig, WarmupOrder};
use crate::estimators::shift::ShiftConfig;
use crate::StateError;
use rand::{Rng, RngCore};
use serde::{Deserialize, Serialize};

/// Parameters of `lqm-ts`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LqmTsConfig {
    /// The quality part (its `failure_quality` is ignored: failures go to the risk model).
    pub lqm: LqmConfig,
    /// The risk part.
    pub risk: RiskConfig,
    /// `C_ref` in USD; unset means the mean expected cost of the eligible candidates.
    pub cost_ref_usd: Option<f64>,
    /// Relative width of the top group: candidates with `V ≥ (1 − tolerance)·V_best`.
    pub quality_tolerance: f64,
    /// How expected latency discounts quality in `q`.
    pub latency: LatencyTerm,
    /// Extra rankings drawn to estimate the propensity of the first choice (0: not
    /// estimated), as in `ts-deadline`. Each costs one more Thompson draw per candidate.
    pub propensity_samples: u32,
    /// How the top group is ordered (default: cheapest first, no budget).
    pub objective: LqmTsObjective,
    /// Change detection on each candidate's quality scores (`threshold = 0`: off).
    pub shift: ShiftConfig,
    /// The most probability per request with which a candidate that lost a quality level in
    /// a detected drop is re-tested, while that level would put it in the top group: the
    /// re-test rule `retest × (1 − freshness)` (0: no re-tests).
    pub retest: f64,
    /// A longer warm-up for a candidate much cheaper than the dearest eligible one (off by
    /// default). Written out only when on.
    #[serde(skip_serializing_if = "CheapWarmup::is_off")]
    pub cheap_warmup: CheapWarmup,
}

/// A longer warm-up for a cheap candidate ([`LqmTsConfig::cheap_warmup`]): its price is
/// evidence the scores lack, so a candidate whose expected cost is at most `1/ratio` of the
/// dearest eligible candidate's (with `against = "others"`: of every other eligible
/// candidate's) needs `factor` times `head.warmup` scores before its estimate ranks it, and
/// its early release needs its interval at `exit_z` below the best lower bound. `ratio = 0`
/// (the default) is off.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheapWarmup {
    /// How many times cheaper than the dearest eligible candidate a candidate must be (≥ 1;
    /// 0: off).
    pub ratio: f64,
    /// Its warm-up, as a multiple of `head.warmup` (≥ 1).
    pub factor: f64,
    /// Its early release's `z` (0: `head.warmup_exit_z`).
    pub exit_z: f64,
    /// Whose price `ratio` compares with: the dearest eligible candidate's (`dearest`, the
    /// default) or the cheapest other eligible candidate's (`others`: only a candidate
    /// `ratio` times cheaper than every other one).
    pub against: CheapAgainst,
}

/// The price a candidate's is compared with ([`CheapWarmup::against`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheapAgainst {
    /// The dearest eligible candidate's.
    #[default]
    Dearest,
    /// The cheapest other eligible candidate's.
    Others,
}

impl Default for CheapWarmup {
    fn default() -> Self {
        CheapWarmup {
            ratio: 0.0,
            factor: 1.0,
            exit_z: 0.0,
            against: CheapAgainst::Dearest,
        }
    }
}

impl CheapWarmup {
    /// Off: no candidate's warm-up changes.
    #[must_use]
    #[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
    pub fn is_off(&self) -> bool {
        self.ratio == 0.0
    }

    fn validate(&self) -> Result<(), crate::ConfigError> {
        if self.ratio != 0.0 && !(self.ratio >= 1.0 && self.ratio.is_finite()) {
            return Err(crate::error::out_of_range(
                "cheap_warmup.ratio",
                self.ratio,
                "must be 0 (off) or at least 1, e.g. 3 for candidates a third of the dearest's \
                 price or less",
            ));
        }
        if !(self.factor >= 1.0 && self.factor.is_finite()) {
            return Err(crate::error::out_of_range(
                "cheap_warmup.factor",
                self.factor,
                "must be at least 1: the cheap candidate's warm-up as a multiple of \
                 head.warmup",
            ));
        }
        crate::error::non_negative("cheap_warmup.exit_z", self.exit_z)?;
        Ok(())
    }
}

/// How `lqm-ts` orders the candidates whose quality is good enough (the top group).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LqmTsObjective {
    /// The top group is judged on estimated good quality `(q − bonus)·(1 − P̃(bad))`, and
    /// ordered by expected cost.
    #[default]
    CheapestInGroup,
    /// The top group is judged on quality `q − bonus` alone; in it the candidates whose
    /// sampled `P̃(bad)` is at most `max_bad` go first, cheapest first, then the others by
    /// sampled `P̃(bad)`.
    RiskBudget { max_bad: f64 },
}

impl LqmTsObjective {
    /// The bad-outcome budget, if any.
    #[must_use]
    pub fn max_bad(self) -> Option<f64> {
        match self {
            LqmTsObjective::CheapestInGroup => None,
            LqmTsObjective::RiskBudget { max_bad } => Some(max_bad),
        }
    }

    fn validate(self) -> Result<(), crate::ConfigError> {
        if let LqmTsObjective::RiskBudget { max_bad } = self {
            if !(0.0..=1.0).contains(&max_bad) {
                return Err(crate::error::out_of_range(
                    "objective.max_bad",
                    max_bad,
                    "must be between 0 and 1, e.g. 0.03 for at most 3% bad outcomes \
                     (omit `objective` for no budget)",
                ));
            }
        }
        Ok(())
    }
}

impl Default for LqmTsConfig {
    fn default() -> Self {
        LqmTsConfig {
            lqm: LqmConfig {
                failure_quality: None,
                alpha_ucb: 0.2,
                ema_beta: 0.03,
                head: LinUcbConfig {
                    warmup: 10,
                    warmup_exit_z: 3.0,
                    gate: true,
                    gate_tie_z: 2.0,
                    warmup_order: WarmupOrder::Attempts,
                    ..LinUcbConfig::default()
                },
                ..LqmConfig::default()
            },
            risk: RiskConfig {
                level_beta: 0.3,
                level_z: 1.0,
                ..RiskConfig::default()
            },
            cost_ref_usd: None,
            quality_tolerance: 0.02,
            latency: LatencyTerm::OverBudget,
            propensity_samples: 0,
            objective: LqmTsObjective::CheapestInGroup,
            shift: ShiftConfig::default(),
            retest: LqmTsConfig::DEFAULT_RETEST,
            cheap_warmup: CheapWarmup::default(),
        }
    }
}

impl LqmTsConfig {
    /// The default of [`LqmTsConfig::retest`] (docs/policies.md, "Quality that changes").
    pub const DEFAULT_RETEST: f64 = 0.2;

    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        self.shift.validate()?;
        crate::error::unit_interval("retest", self.retest)?;
        self.cheap_warmup.validate()?;
        self.lqm.validate()?;
        self.risk.validate()?;
        crate::error::unit_interval("quality_tolerance", self.quality_tolerance)?;
        super::ts_deadline::check_propensity_samples(self.propensity_samples)?;
        self.objective.validate()?;
        self.risk_objective().validate()
    }

    /// The objective of the risk scores `g`: `ts-deadline`'s with the same budget, or good
    /// outcomes per unit of spend.
    fn risk_objective(&self) -> CostObjective {
        match self.objective {
            LqmTsObjective::CheapestInGroup => CostObjective::CostPerGood {
                cost_ref_usd: self.cost_ref_usd,
            },
            LqmTsObjective::RiskBudget { max_bad } => CostObjective::RiskBudget { max_bad },
        }
    }
}

/// Learning state of `lqm-ts`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LqmTsState {
    pub quality: LqmState,
    pub risk: RiskState,
}

/// Where a candidate goes in the ranking, in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Tier {
    /// The optimistic leader whose estimate is not in the top group: LinUCB explores it.
    Exploring,
    /// Estimate within the tolerance of the best estimate: cheapest first.
    Top,
    /// Everyone else, by optimistic `V`.
    Rest,
    /// Held back by the exploration guard: last, by ts-deadline's (negative) score.
    Guarded,
}

/// The upward evidence, in spreads of its residuals, at which a re-tested candidate's
/// quality evidence counts as wholly stale: one score that far above its estimate asks for
/// the next re-test at once (the re-test rule's full rate).
const SUSPECT_SPREADS: f64 = 1.0;

/// A candidate's ranking keys.
struct Keyed {
    tier: Tier,
    /// `V` with LinUCB's optimism.
    optimistic: f64,
    /// `V` without it: the estimate the top group is judged on.
    estimate: f64,
    /// ts-deadline's `g` (with the budget: its `risk-budget` score).
    g: f64,
    /// `1 − P̃(bad)`, this request's draw.
    good: f64,
    cost: f64,
    /// The candidate's declared preference (`Candidate::preference`).
    preference: i32,
    /// `q − bonus`: the quality estimate with its latency discount, without the risk.
    quality: f64,
    /// The latency discount of `q` (what it makes of a quality of 1).
    discount: f64,
    /// Index into the eligible list.
    pos: usize,
}

/// LQM-ContextRoute × deadline-risk Thompson sampling × cost.
#[derive(Clone, Debug)]
pub struct LqmTs {
    cfg: LqmTsConfig,
    quality: LqmState,
    risk: RiskModel,
    /// Shifts detected and not yet taken ([`Policy::take_quality_shifts`]).
    shifts: Vec<QualityShift>,
}

impl LqmTs {
    /// A policy over `k` candidates with `dim` features.
    #[must_use]
    pub fn new(k: usize, dim: usize, cfg: LqmTsConfig) -> LqmTs {
        let mut quality = LqmState::new(k, dim, &cfg.lqm);
        if cfg.shift.active() {
            quality.heads.watch();
        }
        LqmTs {
            quality,
            risk: RiskModel::new(k, cfg.risk),
            cfg,
            shifts: Vec::new(),
        }
    }

    /// The quality part's scores, each candidate's latency estimate `τ̂` faded toward `τ₀`
    /// as its risk belief goes stale ([`RiskModel::freshness`]): a `τ̂` learnt during a
    /// spike stops discounting a provider the ranking left, so it is tried again within a
    /// few stale half-lives, as the risk draws already make it.
    fn quality_scores(&self, ctx: &RankContext<'_>) -> Vec<ScoredCandidate> {
        self.quality
            .score_faded(&self.cfg.lqm, ctx, self.cfg.latency, |i| {
                self.risk.freshness(i, ctx.now)
            })
    }

    /// One ranking from the (deterministic) quality scores and a fresh risk draw.
    fn rank_with(
        &self,
        quality: &[ScoredCandidate],
        ctx: &RankContext<'_>,
        rng: &mut dyn RngCore,
    ) -> Ranking {
        let mut order = sample_scores(&self.risk, self.cfg.risk_objective(), ctx, rng);
        let budget = self.cfg.objective.max_bad().is_some();
        let learnt = ctx
            .eligible
            .iter()
            .any(|&i| self.quality.heads.heads[i].count() > 0);
        // Both lists follow ctx.eligible, so they pair up index by index.
        let mut keyed: Vec<Keyed> = Vec::with_capacity(order.len());
        for (pos, (risk, q)) in order.iter_mut().zip(quality).enumerate() {
            let good = 1.0 - risk.breakdown.bad_probability.unwrap_or(0.0);
            let bonus = q.breakdown.exploration.unwrap_or(0.0);
            let optimistic = q.score * good;
            let u = q.breakdown.quality.unwrap_or(0.0);
            let discount = if u > 0.0 { (q.score - bonus) / u } else { 1.0 };
            keyed.push(Keyed {
                tier: if risk.breakdown.guarded {
                    Tier::Guarded
                } else {
                    Tier::Top
                },
                optimistic,
                // With a budget the risk is the budget's, not the group's.
                estimate: if budget {
                    q.score - bonus
                } else {
                    (q.score - bonus) * good
                },
                g: risk.score,
                good,
                cost: risk.breakdown.cost_usd.unwrap_or(0.0),
                preference: ctx.candidates[ctx.eligible[pos]].preference,
                quality: q.score - bonus,
                discount,
                pos,
            });
            risk.breakdown.quality = q.breakdown.quality;
            risk.breakdown.exploration = q.breakdown.exploration;
            risk.breakdown.latency_ms = q.breakdown.latency_ms;
            risk.breakdown.latency_unseen = q.breakdown.latency_unseen;
            if learnt {
                risk.score = optimistic;
            }
        }
        // The top group's bar: estimates within the tolerance of the best one.
        let bar = if learnt {
            self.place_in_tiers(&mut keyed, ctx, budget)
        } else {
            f64::INFINITY
        };
        keyed.sort_by(|a, b| {
            a.tier.cmp(&b.tier).then_with(|| match a.tier {
                Tier::Top if learnt && !budget => a
                    .cost
                    .total_cmp(&b.cost)
                    .then(b.preference.cmp(&a.preference))
                    .then(b.optimistic.total_cmp(&a.optimistic)),
                Tier::Exploring | Tier::Rest => b.optimistic.total_cmp(&a.optimistic),
                // Before quality feedback, with a budget (in budget by cost, then by
                // P̃(bad)), and for guarded candidates (negative g): g, as ts-deadline
                // ranks them.
                Tier::Top | Tier::Guarded => {
                    b.g.total_cmp(&a.g)
                        .then(b.optimistic.total_cmp(&a.optimistic))
                }
            })
        });
        // The top group at the head of the ranking is as good as its first, and so is a
        // candidate after it whose optimistic value reaches the group's bar: the scores
        // cannot tell it from the group (the default objective; with a budget the group's
        // members differ in risk).
        let mut top = if learnt && !budget && keyed.first().is_some_and(|k| k.tier == Tier::Top) {
            keyed
                .iter()
                .take_while(|k| {
                    k.tier == Tier::Top || (k.tier != Tier::Guarded && k.optimistic >= bar)
                })
                .count()
        } else {
            0
        };
        if learnt {
            if let Some(at) = self.retest_pick(&keyed, ctx, rng) {
                let k = keyed.remove(at);
                order[k.pos].breakdown.retest = true;
                keyed.insert(0, k);
                top = 0;
            }
        }
        let mut ranking = Ranking {
            order: keyed.iter().map(|k| order[k.pos]).collect(),
            propensity: None,
            ..Ranking::default()
        };
        if learnt {
            self.warmup_first(&mut ranking, ctx);
        }
        // A re-test or a warm-up moved first is no member of the group it leads.
        if ranking.order.first().is_some_and(|c| !c.breakdown.warmup) {
            ranking.interchangeable = top;
        }
        ranking
    }
}

impl LqmTs {
    /// The warm-up ([`super::heads::warmup_first`]), longer for the cheap candidates with
    /// `cheap_warmup` on.
    fn warmup_first(&self, ranking: &mut Ranking, ctx: &RankContext<'_>) {
        let head = &self.cfg.lqm.head;
        let cheap = self.cfg.cheap_warmup;
        if cheap.is_off() {
            super::heads::warmup_first(ranking, &self.quality.heads, head);
            return;
        }
        let longer = super::heads::LongerWarmup {
            // The product of a u32 and a factor ≥ 1 (validated), rounded up.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            scores: (f64::from(head.warmup) * cheap.factor).ceil() as u64,
            exit_z: if cheap.exit_z > 0.0 {
                cheap.exit_z
            } else {
                head.warmup_exit_z
            },
        };
        // Past the longer warm-up (the request path's usual case) no candidate can be in
        // either warm-up: no price is looked at.
        let heads = &self.quality.heads;
        if ranking
            .order
            .iter()
            .all(|s| heads.heads[s.index].count() >= longer.scores)
        {
            return;
        }
        // The price each candidate is compared with: the dearest unguarded candidate's, or
        // the cheapest other unguarded candidate's (the two smallest, to leave out its own).
        let costs = ranking
            .order
            .iter()
            .filter(|s| !s.breakdown.guarded)
            .map(|s| (s.index, ctx.expected_cost(s.index)));
        let (mut dearest, mut least, mut second) =
            (0.0, (usize::MAX, f64::INFINITY), f64::INFINITY);
        for (i, c) in costs {
            dearest = f64::max(dearest, c);
            if c < least.1 {
                second = least.1;
                least = (i, c);
            } else {
                second = second.min(c);
            }
        }
        let reference = |i: usize| match cheap.against {
            CheapAgainst::Dearest => dearest,
            CheapAgainst::Others if i == least.0 => second,
            CheapAgainst::Others => least.1,
        };
        super::heads::warmup_first_with(ranking, heads, head, |i| {
            let reference = reference(i);
            (reference > 0.0
                && reference.is_finite()
                && ctx.expected_cost(i) * cheap.ratio <= reference)
                .then_some(longer)
        });
    }

    /// Places the candidates that are not guarded in the top group, the exploring leader or
    /// the rest, once quality is learnt (see the module doc); returns the top group's bar.
    fn place_in_tiers(&self, keyed: &mut [Keyed], ctx: &RankContext<'_>, budget: bool) -> f64 {
        let open = |k: &&Keyed| k.tier != Tier::Guarded;
        let best = keyed
            .iter()
            .filter(open)
            .map(|k| k.estimate)
            .fold(f64::NEG_INFINITY, f64::max);
        let bar = best - self.cfg.quality_tolerance * best.abs();
        let leader = keyed
            .iter()
            .filter(open)
            .max_by(|a, b| a.optimistic.total_cmp(&b.optimistic))
            .map(|k| k.pos);
        // With a budget, candidates whose quality the scores cannot yet tell from the
        // leader's are in the group too: the budget, not the query's noise, decides.
        let tied = if budget {
            self.quality.heads.tied_while_closed(ctx.eligible)
        } else {
            Vec::new()
        };
        // Without a budget, candidates whose scores show their quality within the
        // tolerance of the leader's are judged with the best quality among them, on
        // their own risk and latency: the query's noise does not split them, the price
        // does (a cheap provider is not left for a dearer equal one).
        let equivalent = if budget {
            Vec::new()
        } else {
            self.quality
                .heads
                .equivalent(ctx.eligible, ctx.features, self.cfg.quality_tolerance)
        };
        let equivalent_quality = keyed
            .iter()
            .filter(|k| equivalent.contains(&ctx.eligible[k.pos]) && k.discount > 0.0)
            .map(|k| k.quality / k.discount)
            .fold(f64::NEG_INFINITY, f64::max);
        for k in keyed.iter_mut().filter(|k| k.tier != Tier::Guarded) {
            let as_equivalent = equivalent.contains(&ctx.eligible[k.pos])
                && equivalent_quality * k.discount * k.good >= bar;
            k.tier = if k.estimate >= bar || tied.contains(&ctx.eligible[k.pos]) || as_equivalent {
                Tier::Top
            } else if Some(k.pos) == leader {
                Tier::Exploring
            } else {
                Tier::Rest
            };
        }
        bar
    }

    /// The re-test rule: the place in `keyed` (ranked, the first excepted) of a candidate to
    /// move first, if any. A candidate that lost a quality level in a detected drop, and whose
    /// quality at that level would be in the top group's tolerance (`level × its latency
    /// discount ≥ (1 − quality_tolerance) × the best q − bonus`), is re-tested with
    /// probability `retest × (1 − f)`, `f` the freshness of its evidence
    /// ([`RiskModel::freshness`]: `2^(−age/h)`, the age since its last attempt and `h` the
    /// stale half-life the latency and failure beliefs fade with), and with probability
    /// `retest` while its scores lean upward ([`SUSPECT_SPREADS`]). One draw per such
    /// candidate, in ranked order; none where there is no such candidate.
    fn retest_pick(
        &self,
        keyed: &[Keyed],
        ctx: &RankContext<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<usize> {
        if self.cfg.retest <= 0.0 {
            return None;
        }
        let heads = &self.quality.heads;
        let best = keyed
            .iter()
            .filter(|k| k.tier != Tier::Guarded)
            .map(|k| k.quality)
            .fold(f64::NEG_INFINITY, f64::max);
        let bar = best - self.cfg.quality_tolerance * best.abs();
        keyed
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, k)| k.tier != Tier::Guarded)
            .find(|(_, k)| {
                let i = ctx.eligible[k.pos];
                let Some(level) = heads.lost_level(i, ctx.features) else {
                    return false;
                };
                if level * k.discount < bar {
                    return false;
                }
                let stale = if heads.leaning_up(i, SUSPECT_SPREADS) {
                    1.0
                } else {
                    1.0 - self.risk.freshness(i, ctx.now)
                };
                rng.random::<f64>() < self.cfg.retest * stale
            })
            .map(|(at, _)| at)
    }
}

impl Policy for LqmTs {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LqmTs
    }

    fn rank(&self, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> Ranking {
        let quality = self.quality_scores(ctx);
        let mut ranking = self.rank_with(&quality, ctx, rng);
        if self.cfg.propensity_samples > 0 {
            if let Some(first) = ranking.order.first().map(|s| s.index) {
                // The quality part is deterministic: only the risk draws are repeated.
                let hits = (0..self.cfg.propensity_samples)
                    .filter(|_| {
                        self.rank_with(&quality, ctx, rng)
                            .order
                            .first()
                            .map(|s| s.index)
                            == Some(first)
                    })
                    .count();
                ranking.propensity = Some(Propensity::estimated(hits, self.cfg.propensity_samples));
            }
        }
        ranking
    }

    fn first_choice_distribution(
        &self,
        ctx: &RankContext<'_>,
        rng: &mut dyn RngCore,
        draws: u32,
    ) -> FirstChoice {
        let quality = self.quality_scores(ctx);
        FirstChoice::from_draws(ctx, draws, || {
            self.rank_with(&quality, ctx, rng)
                .order
                .first()
                .map(|s| s.index)
        })
    }

    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        self.quality.heads.note_try(obs);
        // Before the risk model learns the attempt, which makes the candidate fresh again.
        let fresh = self.risk.freshness(obs.candidate, obs.now);
        self.quality
            .observe_latency_faded(&self.cfg.lqm, obs, fresh);
        self.risk.observe(obs);
    }

    fn recovered(&mut self, candidate: usize, now: crate::Timestamp) {
        self.risk.forget_failures(candidate, now);
    }

    fn observe_quality(&mut self, obs: &QualityObservation<'_>) {
        let shift = self.quality.heads.learn_watching(
            obs.candidate,
            obs.features,
            obs.quality,
            obs.now,
            &self.cfg.shift,
        );
        if let Some(shift) = shift {
            if self.shifts.len() >= MAX_PENDING_SHIFTS {
                self.shifts.remove(0);
            }
            self.shifts.push(shift);
        }
    }

    fn take_quality_shifts(&mut self) -> Vec<QualityShift> {
        std::mem::take(&mut self.shifts)
    }

    fn export_state(&self) -> PolicyState {
        PolicyState::LqmTs(LqmTsState {
            quality: self.quality.clone(),
            risk: self.risk.export(),
        })
    }

    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        match other {
            PolicyState::LqmTs(s) => {
                self.quality.merge(&s.quality)?;
                self.risk.merge(&s.risk)
            }
            _ => Err(wrong_policy(PolicyKind::LqmTs, other)),
        }
    }

    fn quality_observations(&self) -> Option<Vec<u64>> {
        Some(self.quality.heads.quality_observations())
    }

    fn deadline_miss_estimate(&self, candidate: usize, ctx: &RankContext<'_>) -> Option<f64> {
        ctx.deadline.map(|_| self.risk.point(candidate, ctx).1)
    }

    fn latency_outlook(
        &self,
        candidate: usize,
        ctx: &RankContext<'_>,
    ) -> Option<crate::hedge::LatencyOutlook> {
        Some(self.risk.outlook(candidate, ctx))
    }

    fn take_slice_evictions(&mut self) -> u64 {
        self.risk.take_evictions()
    }
}
