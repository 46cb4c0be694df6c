//! Per-candidate LinUCB quality heads, shared by `lqm`, `lqm-ts`, `linucb` and `additive`,
//! and the disjoint-LinUCB baseline itself (`û + α·sqrt(xᵀA⁻¹x)`, latency ignored).

use super::{
    check_len, wrong_policy, AttemptObservation, Policy, PolicyKind, PolicyState, Propensity,
    QualityObservation, QualityShift, RankContext, Ranking, ScoreBreakdown, ScoredCandidate,
};
use crate::estimators::linalg::{
    dot_f32, dots, dots_f32, nonzeros, packed_outer, packed_outer_f32,
};
use crate::estimators::linucb::{
    context_wins, signal_shown, LinUcbConfig, LinUcbHead, RememberedLevel, WarmupOrder,
};
use crate::estimators::shift::{ShiftConfig, ShiftDetector, ShiftDirection};
use crate::StateError;
use rand::RngCore;
use serde::{Deserialize, Serialize};

/// One LinUCB head per candidate, and how often each candidate was tried.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeadsState {
    pub heads: Vec<LinUcbHead>,
    /// Attempts per candidate that reached it (client errors excluded), for the warm-up.
    #[serde(default)]
    pub tries: Vec<u64>,
    /// Count, sum and sum of squares of the scores each head has learnt, kept only when
    /// the warm-up can release a candidate early (`warmup_exit_z > 0`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moments: Vec<[f64; 3]>,
    /// A change detector on each candidate's scores ([`Self::learn_watching`]), kept only
    /// when detection is on (`lqm-ts`'s `shift`); absent in state saved before it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub watches: Vec<Watch>,
}

/// The change detector of one candidate's quality scores, and the level the candidate had
/// before its last detected drop.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Watch {
    pub detector: ShiftDetector,
    /// The head's estimate just before the last detected drop, until a rise is detected:
    /// what re-tests look for (`lqm-ts`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<RememberedLevel>,
}

impl HeadsState {
    pub(crate) fn new(k: usize, dim: usize, cfg: LinUcbConfig) -> HeadsState {
        HeadsState {
            heads: (0..k).map(|_| LinUcbHead::new(dim, cfg)).collect(),
            tries: vec![0; k],
            moments: if cfg.warmup_exit_z > 0.0 {
                vec![[0.0; 3]; k]
            } else {
                Vec::new()
            },
            watches: Vec::new(),
        }
    }

    /// Turns change detection on (one [`Watch`] per candidate); a state that has them keeps
    /// them.
    pub(crate) fn watch(&mut self) {
        if self.watches.len() != self.heads.len() {
            self.watches = vec![Watch::default(); self.heads.len()];
        }
    }

    /// [`Self::learn`], with candidate `i`'s change detector told the score's residual
    /// against its head's prediction first. On a detected shift the candidate's evidence from
    /// before the run that set it off is discarded (its head, moments and attempts keep only
    /// the run), which gives it a fresh warm-up; a drop remembers the level the head had (the
    /// higher one if it drops again), a rise at least halfway back to it forgets it. Without detection (or a head without the centre's sums, which the
    /// prediction needs) it is [`Self::learn`].
    pub(crate) fn learn_watching(
        &mut self,
        i: usize,
        x: &[f64],
        u: f64,
        now: crate::Timestamp,
        cfg: &ShiftConfig,
    ) -> Option<QualityShift> {
        let prediction = self.heads[i].centred_prediction(x);
        let alarm = match (self.watches.get_mut(i), prediction) {
            (Some(w), Some(p)) => w.detector.observe(u - p, u, cfg),
            _ => None,
        };
        self.learn(i, x, u, now);
        let alarm = alarm?;
        let before = self.heads[i].remember();
        let from = before.as_ref().map_or(alarm.run_mean, |l| l.mean);
        let watch = &mut self.watches[i];
        watch.lost = match alarm.direction {
            // The higher of the levels lost, if it drops again before coming back.
            ShiftDirection::Down => match (watch.lost.take(), before) {
                (Some(old), Some(new)) if new.mean > old.mean => Some(new),
                (Some(old), _) => Some(old),
                (None, new) => new,
            },
            // Back at least halfway to the level lost: the watch is over. A smaller rise
            // (or the noise of a head just cut to a few scores) keeps it.
            ShiftDirection::Up => watch
                .lost
                .take()
                .filter(|l| alarm.run_mean < from + (l.mean - from) / 2.0),
        };
        self.keep_newest(i, alarm.scores);
        Some(QualityShift {
            candidate: i,
            direction: alarm.direction,
            from,
            to: alarm.run_mean,
            scores: alarm.scores,
            at: now,
        })
    }

    /// Candidate `i`'s evidence reduced to its newest `n` scores: its head, its moments
    /// (recomputed from the head's window) and its attempts (set to what remains).
    fn keep_newest(&mut self, i: usize, n: u64) {
        let head = &mut self.heads[i];
        head.retain_newest(usize::try_from(n).unwrap_or(usize::MAX));
        if let Some(m) = self.moments.get_mut(i) {
            *m = head
                .window_scores()
                .fold([0.0; 3], |[c, s, q], u| [c + 1.0, s + u, q + u * u]);
        }
        if let Some(t) = self.tries.get_mut(i) {
            *t = head.count();
        }
    }

    /// Whether candidate `i` lost a level in a detected drop, and that level's estimate for
    /// `x` (`None`: no such level).
    pub(crate) fn lost_level(&self, i: usize, x: &[f64]) -> Option<f64> {
        self.watches.get(i)?.lost.as_ref().map(|l| l.estimate(x))
    }

    /// Whether candidate `i`'s scores lean upward by at least `level` spreads.
    pub(crate) fn leaning_up(&self, i: usize, level: f64) -> bool {
        self.watches
            .get(i)
            .is_some_and(|w| w.detector.leaning_up(level))
    }

    /// Quality scores each head has learnt (every score ever folded in).
    #[must_use]
    pub fn quality_observations(&self) -> Vec<u64> {
        self.heads.iter().map(LinUcbHead::count).collect()
    }

    /// Folds score `u` for context `x` into candidate `i`'s head (and its moments).
    pub(crate) fn learn(&mut self, i: usize, x: &[f64], u: f64, now: crate::Timestamp) {
        self.heads[i].update(x, u, now);
        if let Some(m) = self.moments.get_mut(i) {
            m[0] += 1.0;
            m[1] += u;
            m[2] += u * u;
        }
    }

    /// `(mean − z·s/√n, mean + z·s/√n)` of candidate `i`'s scores, `s` the sample deviation
    /// floored at [`EXIT_SD_FLOOR`]; `None` before two scores.
    fn score_bounds(&self, i: usize, z: f64) -> Option<(f64, f64)> {
        let (n, mean, sd) = self.score_moments(i)?;
        let half = z * sd / n.sqrt();
        Some((mean - half, mean + half))
    }

    /// The count, mean and deviation (floored at [`EXIT_SD_FLOOR`]) of candidate `i`'s
    /// scores; `None` before two scores.
    fn score_moments(&self, i: usize) -> Option<(f64, f64, f64)> {
        let [n, sum, sum_sq] = *self.moments.get(i)?;
        if n < 2.0 {
            return None;
        }
        let mean = sum / n;
        let var = ((sum_sq - sum * mean) / (n - 1.0)).max(0.0);
        Some((n, mean, var.sqrt().max(EXIT_SD_FLOOR)))
    }

    /// `(û, width)` of each candidate in `eligible`, in that order: the head's
    /// `(xᵀθ, sqrt(xᵀA⁻¹x))`, or, with the gate on and the heads' pooled record not showing
    /// the query worth knowing ([`Self::context_helps`]), each head's context-free mean
    /// `Σu/(λr + n)` ([`LinUcbHead::context_free`]) with the head's own width. That width is
    /// never below the context-free one (`xᵀA⁻¹x ≥ |x|²/(λr + n)`) and stays wide for
    /// queries unlike the ones a candidate was tried on, so a candidate whose first scores
    /// came out low keeps being tried now and then: with the context-free width
    /// `1/sqrt(λr + n)` (the gate's first version) `lqm-ts` locked onto the second-best
    /// provider of `priority-mismatch-k10` in 3 of 35 seeds.
    ///
    /// With `gate_retry = c > 0` the closed gate's width is at least UCB1's count-based
    /// `sqrt(c·ln N/m_i)`, `m_i = λr + n_i`, `N = Σ_j m_j` over the interface's heads: it
    /// grows while a candidate goes untried, so every candidate is retried within a bounded
    /// number of scores, however its first ones came out ([`Self::retry_width`]).
    ///
    /// With `gate_tie_z > 0` the candidates the closed gate cannot yet tell apart from the
    /// leader ([`Self::tied`]) rank on their centred estimates `ū + xᵀA⁻¹(b − ū·Σx)` with
    /// their heads' widths instead: a ranking that is the same for every request sends all
    /// the traffic of two near-tied providers to one of them, which queues under load.
    pub(crate) fn estimates(&self, eligible: &[usize], x: &[f64]) -> Vec<(f64, f64)> {
        let contextual = self.contextual_estimates(eligible, x);
        if self.gate_closed() {
            let log_total = self.log_total();
            let tied = self.tied(eligible);
            return eligible
                .iter()
                .zip(contextual)
                .map(|(&i, (u, w))| match self.heads[i].context_free() {
                    Some(_) if tied.contains(&i) => (self.heads[i].centred_estimate(x), w),
                    Some((mean, free_width)) => {
                        let retry = self.retry_width(i, free_width, log_total);
                        (mean, w.max(retry))
                    }
                    None => (u, w),
                })
                .collect();
        }
        contextual
    }

    /// The near-ties of [`Self::tied`] while the gate is closed (empty while it is open).
    pub(crate) fn tied_while_closed(&self, eligible: &[usize]) -> Vec<usize> {
        if self.gate_closed() {
            self.tied(eligible)
        } else {
            Vec::new()
        }
    }

    /// The candidates in `eligible` as good as the leader (the highest mean score) for the
    /// query `x`, as far as the scores show: their mean score's interval (`gate_tie_z`
    /// standard errors) no wider than `2·tolerance` times the leader's mean and reaching
    /// `(1 − tolerance)` times it, and, while the gate is open, their estimate for `x` within
    /// `gate_tie_z` standard errors of the leader's (`s·sqrt(w_i² + w_lead²)`, `s` the
    /// scores' deviation, `w` the heads' widths): the query tells them apart no better than
    /// noise. Unlike [`Self::tied`], a candidate with few scores (a wide interval) is not
    /// among them, nor one the query clearly separates. The leader is included; empty with
    /// the knob off or when that is the leader alone.
    pub(crate) fn equivalent(&self, eligible: &[usize], x: &[f64], tolerance: f64) -> Vec<usize> {
        let Some((z, bounds)) = self.tie_bounds(eligible) else {
            return Vec::new();
        };
        let Some(&(lead, (lead_lo, lead_hi))) = bounds
            .iter()
            .max_by(|a, b| (a.1 .0 + a.1 .1).total_cmp(&(b.1 .0 + b.1 .1)))
        else {
            return Vec::new();
        };
        let lead_mean = f64::midpoint(lead_lo, lead_hi);
        let mut equivalent: Vec<usize> = bounds
            .iter()
            .filter(|(_, (lo, hi))| {
                hi - lo <= 2.0 * tolerance * lead_mean && *hi >= (1.0 - tolerance) * lead_mean
            })
            .map(|(i, _)| *i)
            .collect();
        if !self.gate_closed() && equivalent.len() > 1 {
            let contextual = self.contextual_estimates(&equivalent, x);
            let at = |i: usize| equivalent.iter().position(|&e| e == i);
            if let Some(l) = at(lead) {
                let (u_lead, w_lead) = contextual[l];
                let keep: Vec<usize> = equivalent
                    .iter()
                    .zip(&contextual)
                    .filter(|(&i, (u, w))| {
                        let sd = self.score_sd(i).max(self.score_sd(lead));
                        (u - u_lead).abs() <= z * sd * (w * w + w_lead * w_lead).sqrt()
                    })
                    .map(|(&i, _)| i)
                    .collect();
                equivalent = keep;
            }
        }
        if equivalent.len() < 2 {
            Vec::new()
        } else {
            equivalent
        }
    }

    /// The deviation of candidate `i`'s scores, floored at [`EXIT_SD_FLOOR`] (the floor
    /// before two scores).
    fn score_sd(&self, i: usize) -> f64 {
        self.score_moments(i).map_or(EXIT_SD_FLOOR, |(_, _, sd)| sd)
    }

    /// `gate_tie_z` and the mean-score interval of each candidate in `eligible` that has
    /// one ([`Self::score_bounds`]); `None` with the knob off.
    fn tie_bounds(&self, eligible: &[usize]) -> Option<(f64, Vec<ScoreBounds>)> {
        let z = self.heads.first().map_or(0.0, |h| h.config().gate_tie_z);
        (z > 0.0).then(|| {
            let bounds = eligible
                .iter()
                .filter_map(|&i| self.score_bounds(i, z).map(|b| (i, b)))
                .collect();
            (z, bounds)
        })
    }

    /// The closed gate's near-ties ([`LinUcbConfig::gate_tie_z`]): the candidates in
    /// `eligible` whose mean-score interval reaches the lower end of the leader's (the one
    /// with the highest mean), the leader included; empty when that is the leader alone,
    /// the knob is off, or the moments are not kept.
    fn tied(&self, eligible: &[usize]) -> Vec<usize> {
        let Some((_, bounds)) = self.tie_bounds(eligible) else {
            return Vec::new();
        };
        // The leader has the highest mean, the middle of its interval.
        let Some(lead_low) = bounds
            .iter()
            .map(|(_, (lo, hi))| (lo + hi, *lo))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, lo)| lo)
        else {
            return Vec::new();
        };
        let tied: Vec<usize> = bounds
            .iter()
            .filter(|(_, (_, hi))| *hi >= lead_low)
            .map(|(i, _)| *i)
            .collect();
        if tied.len() < 2 {
            Vec::new()
        } else {
            tied
        }
    }

    /// `ln N`, `N = Σ_j m_j` the context-free models' counts `m_j = λr + n_j` over the
    /// interface's gated heads (0 while `N ≤ 1`).
    fn log_total(&self) -> f64 {
        let total: f64 = self
            .heads
            .iter()
            .filter_map(LinUcbHead::context_free)
            .map(|(_, w)| w.powi(-2))
            .sum();
        total.max(1.0).ln()
    }

    /// The closed gate's least width for candidate `i`, `sqrt(c·ln N/m_i)` with
    /// `c = gate_retry` (0 when off), from its context-free width `1/sqrt(m_i)`.
    fn retry_width(&self, i: usize, free_width: f64, log_total: f64) -> f64 {
        let c = self.heads[i].config().gate_retry;
        free_width * (c * log_total).sqrt()
    }

    /// Whether the gate is on and keeps the contextual heads out of the ranking.
    fn gate_closed(&self) -> bool {
        self.heads.iter().all(|h| h.gate_record().is_some()) && !self.context_helps()
    }

    /// The gate, one decision for the interface: whether the centred heads predicted the
    /// scores they were given better than the heads' mean scores did, by the margin, summed
    /// over every candidate. Pooled, the candidates that get most of the traffic decide for
    /// those that get too little to show it: judged one by one, a candidate ranked by its
    /// mean alone would seldom be tried where its queries make it the best.
    #[must_use]
    pub fn context_helps(&self) -> bool {
        let (mut free, mut context, mut cross, mut cross_sq) = (0.0, 0.0, 0.0, 0.0);
        let (mut margin, mut z) = (0.0, 0.0);
        for h in &self.heads {
            if let Some(g) = h.gate_record() {
                let (f, c, _) = g.sums();
                free += f;
                context += c;
                let (s, s2) = g.signal();
                cross += s;
                cross_sq += s2;
            }
            margin = h.config().gate_margin;
            z = h.config().gate_z;
        }
        if z > 0.0 {
            signal_shown(cross, cross_sq, z)
        } else {
            context_wins(free, context, margin)
        }
    }

    /// `(û, sqrt(xᵀA⁻¹x))` of each candidate in `eligible`, in that order. For a query with
    /// few nonzero features ([`sparse_limit`]) the widths are read entry by entry from each
    /// `A⁻¹` in double precision; otherwise they are dot products of each packed `A⁻¹` with
    /// `packed_outer(x)` (computed once), four heads at a time, in single precision when the
    /// heads keep a single-precision copy.
    fn contextual_estimates(&self, eligible: &[usize], x: &[f64]) -> Vec<(f64, f64)> {
        // A short query: a few nonzero features, read straight from A⁻¹ (double precision).
        if let Some(nz) = nonzeros(x, sparse_limit(eligible.len())) {
            return eligible
                .iter()
                .map(|&i| {
                    let h = &self.heads[i];
                    (h.estimate_sparse(&nz), h.width_sq_sparse(&nz).sqrt())
                })
                .collect();
        }
        let fast = eligible.iter().all(|&i| self.heads[i].fast_width());
        let (outer, outer32) = if fast {
            (Vec::new(), packed_outer_f32(x))
        } else {
            (packed_outer(x), Vec::new())
        };
        let mut out = Vec::with_capacity(eligible.len());
        let mut quads = eligible.chunks_exact(4);
        for q in &mut quads {
            let widths: [f64; 4] = if fast {
                let h = |k: usize| self.heads[q[k]].a_inv_packed_f32();
                dots_f32([h(0), h(1), h(2), h(3)], &outer32).map(f64::from)
            } else {
                let h = |k: usize| self.heads[q[k]].a_inv_packed();
                dots([h(0), h(1), h(2), h(3)], &outer)
            };
            for (&i, w) in q.iter().zip(widths) {
                out.push((self.heads[i].estimate(x), w.max(0.0).sqrt()));
            }
        }
        for &i in quads.remainder() {
            let h = &self.heads[i];
            let w = if fast {
                f64::from(dot_f32(h.a_inv_packed_f32(), &outer32))
            } else {
                h.width_sq_outer(&outer)
            };
            out.push((h.estimate(x), w.max(0.0).sqrt()));
        }
        out
    }

    /// Counts an attempt on candidate `obs.candidate` (not a client error).
    pub(crate) fn note_try(&mut self, obs: &AttemptObservation<'_>) {
        if obs.outcome.status != crate::AttemptStatus::ClientError {
            if let Some(t) = self.tries.get_mut(obs.candidate) {
                *t += 1;
            }
        }
    }

    pub(crate) fn merge(&mut self, other: &HeadsState) -> Result<(), StateError> {
        check_len("candidates", self.heads.len(), other.heads.len())?;
        if self.tries.len() == other.tries.len() {
            for (t, o) in self.tries.iter_mut().zip(&other.tries) {
                *t += o;
            }
        }
        if self.moments.len() == other.moments.len() {
            for (m, o) in self.moments.iter_mut().zip(&other.moments) {
                for (a, b) in m.iter_mut().zip(o) {
                    *a += b;
                }
            }
        }
        if self.watches.len() == other.watches.len() {
            for ((w, o), h) in self.watches.iter_mut().zip(&other.watches).zip(&self.heads) {
                if h.count() == 0 && h.window_len() == 0 {
                    // Nothing learnt here: the union is the other's watch.
                    w.clone_from(o);
                    continue;
                }
                w.detector.merge(&o.detector);
                if o.lost
                    .as_ref()
                    .is_some_and(|l| w.lost.as_ref().is_none_or(|m| l.mean > m.mean))
                {
                    w.lost.clone_from(&o.lost);
                }
            }
        }
        for (h, o) in self.heads.iter_mut().zip(&other.heads) {
            h.merge(o)?;
        }
        Ok(())
    }
}

/// Parameters of the `linucb` baseline.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinUcbPolicyConfig {
    /// Exploration scale α.
    pub alpha_ucb: f64,
    /// The quality heads.
    pub head: LinUcbConfig,
    /// Quality recorded for an attempt that failed or timed out (`None`: learn nothing).
    pub failure_quality: Option<f64>,
}

impl Default for LinUcbPolicyConfig {
    fn default() -> Self {
        LinUcbPolicyConfig {
            alpha_ucb: 0.5,
            head: LinUcbConfig::default(),
            failure_quality: Some(0.0),
        }
    }
}

impl LinUcbPolicyConfig {
    pub(crate) fn validate(&self) -> Result<(), crate::ConfigError> {
        crate::error::non_negative("alpha_ucb", self.alpha_ucb)?;
        if let Some(q) = self.failure_quality {
            crate::error::unit_interval("failure_quality", q)?;
        }
        self.head.validate()
    }
}

/// The most nonzero features for which [`HeadsState::estimates`] reads each of `k` heads'
/// `A⁻¹` entry by entry (`n(n+1)/2` terms per head, ~0.6 ns each) rather than in one dense
/// pass (the query's packed outer product once, ~450 ns, then ~110 ns per head at d = 64):
/// sparse while `k·n(n+1)/2 ≤ 725 + 177·k`, i.e. up to 28 nonzeros for 3 heads, 21 for 10.
/// Measured with `cargo bench -p equiroute-core --bench kernels -- estimates` (docs/benchmarks.md).
fn sparse_limit(k: usize) -> usize {
    let budget = (725 + 177 * k) / k.max(1);
    // The largest n with n(n+1)/2 ≤ budget, exactly: ⌊(√(8·budget + 1) − 1) / 2⌋.
    ((8 * budget + 1).isqrt() - 1) / 2
}

/// The least sample deviation the warm-up's early release assumes (scores lie in [0, 1]; two
/// or three equal scores must not make a candidate look certain).
const EXIT_SD_FLOOR: f64 = 0.1;

/// A candidate and its mean score's interval `(low, high)` ([`HeadsState::score_bounds`]).
type ScoreBounds = (usize, (f64, f64));

/// Moves candidates with fewer than `warmup` quality scores to the front (fewest scores
/// first, or fewest attempts with [`WarmupOrder::Attempts`]; otherwise in ranked order):
/// every candidate is tried a few times before the estimates decide. Without it, an
/// unexplored head's `û = 0` looks dominated next to providers whose quality is high, and
/// the dominance shrink stops LQM from ever trying it. A candidate held
/// back by a guardrail is never forced, nor one already tried `10 × warmup` times without
/// yielding that many scores (it keeps failing or its feedback never comes), nor, with
/// `warmup_exit_z > 0`, one whose scores are clearly below another's (see
/// [`LinUcbConfig::warmup_exit_z`]).
pub(crate) fn warmup_first(ranking: &mut Ranking, heads: &HeadsState, cfg: &LinUcbConfig) {
    warmup_first_with(ranking, heads, cfg, |_| None);
}

/// A longer warm-up for one candidate ([`warmup_first_with`]): its own number of scores and
/// its own early release's `z`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LongerWarmup {
    pub scores: u64,
    pub exit_z: f64,
}

/// [`warmup_first`], with the candidates for which `longer` (by candidate index) answers
/// warmed up for its number of scores (and `10 ×` as many attempts) and released early only
/// when their interval at its `z` is below the best lower bound (the others' `z` unchanged).
pub(crate) fn warmup_first_with(
    ranking: &mut Ranking,
    heads: &HeadsState,
    cfg: &LinUcbConfig,
    longer: impl Fn(usize) -> Option<LongerWarmup>,
) {
    if cfg.warmup == 0 {
        return;
    }
    let warmup = |s: &ScoredCandidate| longer(s.index).map_or(u64::from(cfg.warmup), |l| l.scores);
    let count = |s: &ScoredCandidate| heads.heads[s.index].count();
    let unscored = |s: &ScoredCandidate| {
        let tries = heads.tries.get(s.index).copied().unwrap_or(0);
        let warmup = warmup(s);
        !s.breakdown.guarded && count(s) < warmup && tries < 10 * warmup
    };
    // Past the warm-up (the request path's usual case) nothing below is computed.
    if !ranking.order.iter().any(unscored) {
        return;
    }
    // Without moments (`warmup_exit_z = 0`) there are no bounds and nobody is released.
    let best_lower = ranking
        .order
        .iter()
        .filter_map(|s| heads.score_bounds(s.index, cfg.warmup_exit_z))
        .map(|(lower, _)| lower)
        .fold(f64::NEG_INFINITY, f64::max);
    let released = |s: &ScoredCandidate| {
        let z = longer(s.index).map_or(cfg.warmup_exit_z, |l| l.exit_z);
        heads
            .score_bounds(s.index, z)
            .is_some_and(|(_, upper)| upper < best_lower)
    };
    let cold = |s: &ScoredCandidate| unscored(s) && !released(s);
    if !ranking.order.iter().any(cold) {
        return;
    }
    for s in &mut ranking.order {
        s.breakdown.warmup = cold(s);
    }
    // Attempts, never fewer than the scores (state saved before `tries` was kept has none).
    let key = |s: &ScoredCandidate| match cfg.warmup_order {
        WarmupOrder::Scores => count(s),
        WarmupOrder::Attempts => heads.tries.get(s.index).copied().unwrap_or(0).max(count(s)),
    };
    ranking
        .order
        .sort_by_key(|s| if s.breakdown.warmup { key(s) } else { u64::MAX });
}

/// The quality that a failed or timed-out attempt teaches, if any.
pub(crate) fn failure_lesson(
    obs: &AttemptObservation<'_>,
    failure_quality: Option<f64>,
) -> Option<f64> {
    let s = obs.outcome.status;
    if s.is_provider_failure() || s == crate::AttemptStatus::Timeout {
        failure_quality
    } else {
        None
    }
}

/// Disjoint LinUCB: `û_i + α·sqrt(xᵀA_i⁻¹x)`.
#[derive(Clone, Debug)]
pub struct LinUcbPolicy {
    cfg: LinUcbPolicyConfig,
    heads: HeadsState,
}

impl LinUcbPolicy {
    /// A policy over `k` candidates with `dim` features.
    #[must_use]
    pub fn new(k: usize, dim: usize, cfg: LinUcbPolicyConfig) -> LinUcbPolicy {
        LinUcbPolicy {
            cfg,
            heads: HeadsState::new(k, dim, cfg.head),
        }
    }
}

impl Policy for LinUcbPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Linucb
    }

    fn rank(&self, ctx: &RankContext<'_>, _rng: &mut dyn RngCore) -> Ranking {
        let estimates = self.heads.estimates(ctx.eligible, ctx.features);
        let mut r = Ranking {
            order: ctx
                .eligible
                .iter()
                .zip(estimates)
                .map(|(&i, (u, w))| {
                    let bonus = self.cfg.alpha_ucb * w;
                    ScoredCandidate {
                        index: i,
                        score: u + bonus,
                        breakdown: ScoreBreakdown {
                            quality: Some(u),
                            exploration: Some(bonus),
                            ..ScoreBreakdown::default()
                        },
                    }
                })
                .collect(),
            propensity: Some(Propensity::DETERMINISTIC),
            ..Ranking::default()
        };
        r.sort();
        warmup_first(&mut r, &self.heads, &self.cfg.head);
        r
    }

    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        self.heads.note_try(obs);
        if let Some(u) = failure_lesson(obs, self.cfg.failure_quality) {
            self.heads.learn(obs.candidate, obs.features, u, obs.now);
        }
    }

    fn observe_quality(&mut self, obs: &QualityObservation<'_>) {
        self.heads
            .learn(obs.candidate, obs.features, obs.quality, obs.now);
    }

    fn export_state(&self) -> PolicyState {
        PolicyState::Linucb(self.heads.clone())
    }

    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        match other {
            PolicyState::Linucb(h) => self.heads.merge(h),
            _ => Err(wrong_policy(PolicyKind::Linucb, other)),
        }
    }

    fn quality_observations(&self) -> Option<Vec<u64>> {
        Some(self.heads.quality_observations())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::features::Featurizer;

    /// A unit-length query of type `t` (0–4): a constant feature and one per type.
    fn x_of(t: usize) -> [f64; 6] {
        let mut x = [0.0; 6];
        x[0] = std::f64::consts::FRAC_1_SQRT_2;
        x[1 + t] = std::f64::consts::FRAC_1_SQRT_2;
        x
    }

    /// The lock-in guard. Gate closed (scores that do not depend on the query): candidate 0
    /// had ten unlucky scores of 0.47, all on queries of one type, candidate 1 two hundred
    /// of 0.55 on every type. With `lqm-ts`'s α = 0.2, ranked by mean plus the context-free
    /// width `α/sqrt(λr + n)` (the gate's first version), candidate 0 would stay behind for
    /// good (0.49 against 0.56); with its head's width, wide for a type it was never tried
    /// on, it is first again for such a query (0.60 against 0.58), and still behind on the
    /// type it was tried on.
    #[test]
    fn the_closed_gate_retries_a_candidate_whose_first_scores_were_unlucky() {
        let cfg = LinUcbConfig {
            gate: true,
            ..LinUcbConfig::default()
        };
        let mut heads = HeadsState::new(2, 6, cfg);
        for n in 0..200 {
            if n < 10 {
                heads.learn(0, &x_of(0), 0.47, crate::Timestamp(n as f64));
            }
            heads.learn(1, &x_of(n % 5), 0.55, crate::Timestamp(n as f64));
        }
        assert!(!heads.context_helps());
        let alpha = 0.2;
        let score = |(u, w): (f64, f64)| u + alpha * w;
        let fresh = heads.estimates(&[0, 1], &x_of(3));
        let (unlucky, leader) = (score(fresh[0]), score(fresh[1]));
        assert!(unlucky > leader, "fresh query: {unlucky} vs {leader}");
        // The first version's context-free width would have kept it behind.
        let (m0, w0) = heads.heads[0].context_free().unwrap();
        let (m1, w1) = heads.heads[1].context_free().unwrap();
        assert!(
            m0 + alpha * w0 < m1 + alpha * w1 - 0.05,
            "{} vs {}",
            m0 + alpha * w0,
            m1 + alpha * w1
        );
        // Where it was tried, its head's width has shrunk: it stays behind there.
        let tried = heads.estimates(&[0, 1], &x_of(0));
        assert!(score(tried[0]) < score(tried[1]), "{tried:?}");
    }

    /// `equivalent` with a 2% tolerance, every query of one type (the gate stays closed).
    /// Candidates 0 and 1 score 0.7 and 0.9 in turn (mean 0.8, deviation 0.1): after 400
    /// scores each their interval is `0.8 ± 2·0.1/20 = ±0.01`, narrower than the tolerance's
    /// `2·0.02·0.8 = 0.032`, and reaches `0.98·0.8 = 0.784`. Candidate 2 has the same scores
    /// but only 10 (`±0.063`: too wide to say), candidate 3 400 scores of 0.6 and 0.8 (its
    /// interval's top, 0.71, is short of 0.784).
    #[test]
    fn equivalent_candidates_are_the_well_measured_ones_within_the_tolerance() {
        let x = [1.0, 0.0, 0.0, 0.0];
        let cfg = LinUcbConfig {
            gate: true,
            gate_tie_z: 2.0,
            warmup_exit_z: 3.0,
            ..LinUcbConfig::default()
        };
        let mut heads = HeadsState::new(4, 4, cfg);
        for n in 0..400 {
            let t = crate::Timestamp(f64::from(n));
            let high = n % 2 == 0;
            heads.learn(0, &x, if high { 0.9 } else { 0.7 }, t);
            heads.learn(1, &x, if high { 0.7 } else { 0.9 }, t);
            if n < 10 {
                heads.learn(2, &x, if high { 0.9 } else { 0.7 }, t);
            }
            heads.learn(3, &x, if high { 0.8 } else { 0.6 }, t);
        }
        assert!(!heads.context_helps());
        assert_eq!(heads.equivalent(&[0, 1, 2, 3], &x, 0.02), vec![0, 1]);
        // Alone, the leader has no equivalent; without a tolerance, nobody has.
        assert!(heads.equivalent(&[0, 3], &x, 0.02).is_empty());
        assert!(heads.equivalent(&[0, 1], &x, 0.0).is_empty());
    }

    /// The count-based guard (`gate_retry`), where the head's width cannot help: every query
    /// is of one type. Candidate 0's first ten scores came out 0.40 (its true level is 0.61),
    /// candidate 1 scores 0.55. By hand after 10 and 200 scores: `N = 11 + 201`, candidate
    /// 0's width `sqrt(3·ln 212/11) = 1.2087` (its head's is `1/sqrt(11) = 0.3015`). Then,
    /// choosing by `û + 0.2·width` and learning the chosen one's true level: without the
    /// guard candidate 0 is never tried again in 3000 rounds; with it, it is retried within
    /// 50 rounds and leads by the end.
    #[test]
    fn the_retry_guard_brings_back_a_locked_out_candidate_within_bounded_rounds() {
        let x = {
            let mut x = [0.0; 6];
            x[0] = std::f64::consts::FRAC_1_SQRT_2;
            x[1] = std::f64::consts::FRAC_1_SQRT_2;
            x
        };
        for retry in [0.0, 3.0] {
            let cfg = LinUcbConfig {
                gate: true,
                gate_retry: retry,
                ..LinUcbConfig::default()
            };
            let mut heads = HeadsState::new(2, 6, cfg);
            for n in 0..200 {
                if n < 10 {
                    heads.learn(0, &x, 0.40, crate::Timestamp(f64::from(n)));
                }
                heads.learn(1, &x, 0.55, crate::Timestamp(f64::from(n)));
            }
            assert!(!heads.context_helps());
            let (_, w0) = heads.estimates(&[0, 1], &x)[0];
            let want = if retry > 0.0 {
                (3.0 * 212f64.ln() / 11.0).sqrt()
            } else {
                11f64.recip().sqrt()
            };
            assert!((w0 - want).abs() < 1e-6, "{retry}: width {w0} vs {want}");
            let mut first_retry = None;
            let mut last = 1;
            for t in 0..3000 {
                let e = heads.estimates(&[0, 1], &x);
                let pick = usize::from(e[1].0 + 0.2 * e[1].1 > e[0].0 + 0.2 * e[0].1);
                if pick == 0 && first_retry.is_none() {
                    first_retry = Some(t);
                }
                let u = if pick == 0 { 0.61 } else { 0.55 };
                heads.learn(pick, &x, u, crate::Timestamp(f64::from(200 + t)));
                last = pick;
            }
            if retry > 0.0 {
                assert!(first_retry.is_some_and(|t| t < 50), "{first_retry:?}");
                assert_eq!(last, 0);
            } else {
                assert_eq!(first_retry, None);
            }
        }
    }

    /// Both paths of `estimates` against the head's own double-precision `estimate` and
    /// `width_sq` (which the numpy fixtures check): a short query's features go the sparse
    /// way and agree to rounding, a long one's the dense single-precision way and agree to
    /// 1e-6.
    #[test]
    fn sparse_and_dense_estimates_agree_with_the_direct_ones() {
        let f = Featurizer::new(64).unwrap();
        let mut heads = HeadsState::new(3, 64, LinUcbConfig::default());
        for n in 0..60 {
            let x = f.featurize(&format!(
                "question {n} on subject {} with detail {}",
                n % 7,
                n % 3
            ));
            heads.learn(
                n % 3,
                &x,
                (n % 10) as f64 / 10.0,
                crate::Timestamp(n as f64),
            );
        }
        let eligible = [2, 0, 1];
        let short = f.featurize("rust borrow checker");
        let long = f.featurize(
            "how does the borrow checker of the rust compiler decide what lives long enough",
        );
        assert!(
            nonzeros(&short, sparse_limit(3)).is_some()
                && nonzeros(&long, sparse_limit(3)).is_none()
        );
        assert_eq!(
            (sparse_limit(3), sparse_limit(10), sparse_limit(1)),
            (28, 21, 41)
        );
        for (x, tol) in [(&short, 1e-12), (&long, 1e-6)] {
            for (&i, (u, w)) in eligible.iter().zip(heads.estimates(&eligible, x)) {
                let h = &heads.heads[i];
                let (want_u, want_w) = (h.estimate(x), h.width_sq(x).sqrt());
                assert!((u - want_u).abs() < 1e-12, "û {u} vs {want_u}");
                assert!((w - want_w).abs() < tol * want_w, "width {w} vs {want_w}");
            }
        }
    }

    /// Two candidates, five query types (a bias and a one-hot type, unit length), 300
    /// noisy scores each. Where the type does not change the scores the gate stays closed
    /// and the heads rank with `(Σu/(λr + n), 1/sqrt(λr + n))`; where it does (0.85 for two
    /// types, 0.25 for the others) the centred heads predict better and the heads rank.
    #[test]
    fn the_gate_picks_the_mean_on_context_free_scores_and_the_heads_on_contextual_ones() {
        use rand::{Rng, SeedableRng};
        let cfg = LinUcbConfig {
            gate: true,
            ..LinUcbConfig::default()
        };
        for contextual in [false, true] {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
            let mut heads = HeadsState::new(2, 6, cfg);
            let mut sums = [0.0; 2];
            for n in 0..600 {
                let (i, t) = (n % 2, rng.random_range(0..5));
                let level = match (contextual, i) {
                    (false, 0) => 0.6,
                    (false, _) => 0.5,
                    (true, _) if (t + i) % 5 < 2 => 0.85,
                    (true, _) => 0.25,
                };
                let u = (level + 0.4 * (rng.random::<f64>() - 0.5)).clamp(0.0, 1.0);
                sums[i] += u;
                heads.learn(i, &x_of(t), u, crate::Timestamp(n as f64));
            }
            assert_eq!(heads.context_helps(), contextual);
            let x = x_of(3);
            for (i, (u, w)) in [0, 1].into_iter().zip(heads.estimates(&[0, 1], &x)) {
                let h = &heads.heads[i];
                let want_u = if contextual {
                    h.estimate(&x)
                } else {
                    sums[i] / 301.0
                };
                // The head's own width either way (closed: a floor at the context-free one).
                let want_w = h.width_sq(&x).sqrt();
                assert!(contextual || want_w >= 301f64.recip().sqrt());
                assert!(
                    (u - want_u).abs() < 1e-9,
                    "{contextual} {i}: û {u} vs {want_u}"
                );
                assert!(
                    (w - want_w).abs() < 1e-6,
                    "{contextual} {i}: width {w} vs {want_w}"
                );
            }
        }
    }

    /// The closed gate's near-ties (`gate_tie_z`). The gate stays closed (`gate_z = 100`).
    /// Candidates 0 and 1 have the same mean, 0.55: 0 scores 0.65 on queries of type 0 and
    /// 0.45 on type 1, 1 the reverse; candidate 2 scores 0.2 everywhere. Each score is its
    /// level ± 0.05, alternately, 200 per candidate. Without near-ties both rank on their
    /// context-free means for every query (equal to 1e-9); with `gate_tie_z = 2` the two
    /// are not told apart (their intervals, ±2·0.112/√200 = ±0.016, overlap) and rank on
    /// their centred estimates, so each leads on its own type, while candidate 2, far below,
    /// keeps its context-free mean.
    #[test]
    fn near_tied_candidates_rank_on_the_query_while_the_gate_is_closed() {
        for tie in [0.0, 2.0] {
            let cfg = LinUcbConfig {
                gate: true,
                gate_z: 100.0,
                gate_tie_z: tie,
                warmup_exit_z: 3.0,
                ..LinUcbConfig::default()
            };
            let mut heads = HeadsState::new(3, 6, cfg);
            for n in 0..400 {
                let t = (n / 2) % 2;
                let jitter = if (n / 4) % 2 == 0 { 0.05 } else { -0.05 };
                let (a, b) = if t == 0 { (0.65, 0.45) } else { (0.45, 0.65) };
                let at = crate::Timestamp(n as f64);
                if n % 2 == 0 {
                    heads.learn(0, &x_of(t), a + jitter, at);
                    heads.learn(2, &x_of(t), 0.2 + jitter, at);
                } else {
                    heads.learn(1, &x_of(t), b + jitter, at);
                }
            }
            assert!(!heads.context_helps());
            let tied = heads.tied(&[0, 1, 2]);
            for t in 0..2 {
                let x = x_of(t);
                let est = heads.estimates(&[0, 1, 2], &x);
                let mean = |i: usize| heads.heads[i].context_free().unwrap().0;
                assert!((est[2].0 - mean(2)).abs() < 1e-12, "{tie} {t}: {est:?}");
                if tie == 0.0 {
                    assert!(tied.is_empty());
                    assert!((est[0].0 - mean(0)).abs() < 1e-12, "{t}: {est:?}");
                    assert!((est[1].0 - mean(1)).abs() < 1e-12, "{t}: {est:?}");
                    assert!((est[0].0 - est[1].0).abs() < 1e-9, "{t}: {est:?}");
                } else {
                    assert_eq!(tied, vec![0, 1]);
                    let (own, other) = if t == 0 { (0, 1) } else { (1, 0) };
                    assert!(est[own].0 > 0.6 && est[other].0 < 0.5, "{t}: {est:?}");
                    let want = heads.heads[own].centred_estimate(&x);
                    assert!((est[own].0 - want).abs() < 1e-12);
                }
            }
        }
        let bad = LinUcbConfig {
            gate_tie_z: -1.0,
            ..LinUcbConfig::default()
        };
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("gate_tie_z"), "{err}");
    }
}
