//! A LinUCB quality head: ridge regression of quality on query features, kept as `A⁻¹`.
//!
//! - Init: `A = λr·I`, `b = 0`.
//! - Update with (x, u): Sherman–Morrison `A⁻¹ ← A⁻¹ − (A⁻¹x)(A⁻¹x)ᵀ/(1 + xᵀA⁻¹x)`, `b += u·x`.
//! - Sliding window of the last `W` pairs: when it overflows, the oldest pair is *downdated*
//!   the same way with the opposite sign (`A⁻¹ ← A⁻¹ + vvᵀ/(1 − xᵀA⁻¹x)`, `b −= u·x`).
//! - `θ = A⁻¹b` is maintained alongside by the matching recursive-least-squares step, so the
//!   estimate `û = xᵀθ` costs O(d) at decision time; the width `xᵀA⁻¹x` costs d²/2.
//! - `A⁻¹` is symmetric and stored as its packed upper triangle, which halves the width and
//!   the rank-one update.
//! - Centred (`center = true`; off by default): the ridge shrinks towards the head's
//!   mean score `ū` instead of towards 0. The estimate is `ū + xᵀA⁻¹(b − ū·Σx)`, kept as
//!   `xᵀθ + ū·(1 − xᵀθ₁)` with `θ₁ = A⁻¹Σx` maintained by the same recursive step as `θ`
//!   (targets all 1): `xᵀθ₁` is how much of a constant the ridge would recover in this context,
//!   and the mean fills in the rest. Without it, a context unlike the scored ones is estimated
//!   near 0 after a few scores, whatever the provider's quality.
//! - Gated (`gate = true`; off by default, on in `lqm-ts`): beside the head, the same ridge
//!   with one constant feature, `û₀ = Σu/(λr + n)` over the same pairs
//!   ([`LinUcbHead::context_free`]), and a prequential record ([`GateRecord`]): each score is
//!   predicted, before either model learns it, by the mean score `ū` and by the centred head
//!   `ū + δ`, `δ = xᵀA⁻¹(b − ū·Σx)` (nested models: they differ only by what the query adds).
//!   The record sums both squared errors, and `δ·(u − ū)` and its square. While the gate is
//!   closed the policy ranks with `û₀` and the head's own width `sqrt(xᵀA⁻¹x)` (never below
//!   the context-free `1/sqrt(λr + n)`, and wide for queries unlike those the candidate was
//!   tried on: the lock-in guard); it opens, pooled over an interface's heads
//!   (`HeadsState::context_helps`), when the predicted deviations are borne out by the scores,
//!   `Σδ·(u − ū) > gate_z·sqrt(Σ(δ·(u − ū))²)` ([`signal_shown`], `gate_z = 2` by default),
//!   or, with `gate_z = 0`, when the centred heads' squared errors are below
//!   `(1 − gate_margin)` times the means' ([`context_wins`]). The signal test sees a query
//!   that decides which provider is best although it barely improves the prediction of one
//!   score; the error test does not. The record is windowed and merges like `A` and `b`.
//! - Numerics: after 10⁶ rank-one steps the error in `A⁻¹` adds up, so every
//!   `refresh_every` updates `A⁻¹` is recomputed by a Cholesky inverse of `A`, rebuilt exactly
//!   as `λr·I + Σ xxᵀ` from the window (or kept incrementally when there is no window).

use super::linalg::{
    dot, dot_sparse, full_to_packed, packed_len, packed_mat_vec, packed_mat_vec2, packed_quad_form,
    packed_quad_form_sparse, packed_rank_one, packed_rank_two, packed_to_full,
    scaled_identity_quad_form_sparse, spd_inverse,
};
use crate::decision::Timestamp;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Parameters of a [`LinUcbHead`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinUcbConfig {
    /// Ridge regulariser λr (the initial `A = λr·I`).
    pub lambda_r: f64,
    /// Sliding window `W` of (x, u) pairs per head; `None` keeps all history.
    pub window: Option<usize>,
    /// Recompute `A⁻¹` from `A` after this many rank-one updates.
    pub refresh_every: u32,
    /// Rank with exploration widths computed from a single-precision copy of `A⁻¹` (twice
    /// the SIMD width and half the memory traffic; relative error of the width below 1e-6).
    /// The quality estimate `û` and all learning stay in double precision.
    pub fast_width: bool,
    /// Quality observations a candidate collects (tried first) before its estimate ranks it.
    pub warmup: u32,
    /// Shrink towards the head's mean score instead of towards 0 (module docs). Written out
    /// only when on, so that state of uncentred heads reads in earlier releases.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub center: bool,
    /// Releases a candidate from the warm-up before `warmup` scores once its mean score is
    /// clearly below the best candidate's: `mean + z·s/√n < max(mean − z·s/√n)` over the
    /// candidates with two or more scores, `s` the sample deviation floored at 0.1. `0` (the
    /// default) keeps every candidate in the warm-up until `warmup` scores. Written out only
    /// when set, so that the state of earlier configurations reads in earlier releases.
    #[serde(skip_serializing_if = "is_zero")]
    pub warmup_exit_z: f64,
    /// Keep a context-free model and a prequential record beside the head, and rank with
    /// the context-free model until the record shows the query improving the predictions of
    /// held-out scores (module docs). Written out only when on.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub gate: bool,
    /// How much smaller the centred heads' prequential squared error must be than the mean
    /// scores', as a fraction of the latter, before the heads rank (in [0, 1); default 0).
    #[serde(skip_serializing_if = "is_default_margin")]
    pub gate_margin: f64,
    /// The gate's test: `0` compares prequential errors (`gate_margin`); above 0 (the
    /// default, 2), the heads rank once the deviations they predict from their means,
    /// `δ = xᵀA⁻¹(b − ū·Σx)`, are borne out by the scores that follow:
    /// `Σδ·(u − ū) > gate_z·sqrt(Σ(δ·(u − ū))²)`, pooled over the interface's heads
    /// (module docs). Written out only when not the default.
    #[serde(default = "default_gate_z", skip_serializing_if = "is_default_gate_z")]
    pub gate_z: f64,
    /// The closed gate's lock-in guard: a candidate's width is at least UCB1's
    /// `sqrt(gate_retry·ln N/(λr + n))`, `n` its scores and `N` the interface's, so a
    /// candidate left untried is retried within a bounded number of scores. `0` (the
    /// default) is off; only read while the gate is closed. Written out only when set.
    #[serde(skip_serializing_if = "is_zero")]
    pub gate_retry: f64,
    /// While the gate is closed, the candidates whose mean scores are not yet told apart
    /// from the leader's (intervals `mean ± gate_tie_z·s/√n` that overlap the leader's, `s`
    /// the scores' deviation floored at 0.1; needs `warmup_exit_z > 0`, which keeps those
    /// moments) rank on their centred contextual estimates, so that the query, and not one
    /// order for every request, decides between near-tied candidates. `0` (the default) is
    /// off. Written out only when set.
    #[serde(skip_serializing_if = "is_zero")]
    pub gate_tie_z: f64,
    /// Which candidate of those still in the warm-up goes first: the one with the fewest
    /// scores (`scores`, the default) or the fewest attempts (`attempts`). Scores come back
    /// late (a judge's delay, a user's rating); until they do, `scores` keeps putting first
    /// the candidate whose first attempts are still unjudged, while `attempts` takes the
    /// cold candidates in turn. Written out only when not the default.
    #[serde(skip_serializing_if = "WarmupOrder::is_scores")]
    pub warmup_order: WarmupOrder,
}

/// The order of the candidates still in the warm-up ([`LinUcbConfig::warmup_order`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WarmupOrder {
    /// Fewest quality scores first (ties in ranked order).
    #[default]
    Scores,
    /// Fewest attempts first (attempts that reached the candidate, client errors excluded;
    /// ties in ranked order): one attempt per cold candidate in turn, whether or not its
    /// earlier ones are judged yet.
    Attempts,
}

impl WarmupOrder {
    #[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
    fn is_scores(&self) -> bool {
        *self == WarmupOrder::Scores
    }
}

/// The default [`LinUcbConfig::gate_z`].
pub const DEFAULT_GATE_Z: f64 = 2.0;

fn default_gate_z() -> f64 {
    DEFAULT_GATE_Z
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_default_gate_z(z: &f64) -> bool {
    *z == DEFAULT_GATE_Z
}

/// The default [`LinUcbConfig::gate_margin`].
pub const DEFAULT_GATE_MARGIN: f64 = 0.0;

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_default_margin(m: &f64) -> bool {
    *m == DEFAULT_GATE_MARGIN
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(z: &f64) -> bool {
    *z == 0.0
}

impl Default for LinUcbConfig {
    fn default() -> Self {
        LinUcbConfig {
            lambda_r: 1.0,
            window: Some(2000),
            refresh_every: 1024,
            fast_width: true,
            warmup: 3,
            center: false,
            warmup_exit_z: 0.0,
            gate: false,
            gate_margin: DEFAULT_GATE_MARGIN,
            gate_z: DEFAULT_GATE_Z,
            gate_retry: 0.0,
            gate_tie_z: 0.0,
            warmup_order: WarmupOrder::Scores,
        }
    }
}

impl LinUcbConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// A field outside its range, named.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        crate::error::positive("lambda_r", self.lambda_r)?;
        crate::error::non_negative("warmup_exit_z", self.warmup_exit_z)?;
        crate::error::non_negative("gate_z", self.gate_z)?;
        crate::error::non_negative("gate_retry", self.gate_retry)?;
        crate::error::non_negative("gate_tie_z", self.gate_tie_z)?;
        if !(0.0..1.0).contains(&self.gate_margin) {
            return Err(crate::error::out_of_range(
                "gate_margin",
                self.gate_margin,
                "must be in [0, 1): the share of the context-free model's prequential error \
                 the contextual head must save before it ranks (e.g. 0.05)",
            ));
        }
        if self.window == Some(0) {
            return Err(crate::error::out_of_range(
                "window",
                0,
                "must be at least 1, or omitted to keep all history",
            ));
        }
        if self.refresh_every == 0 {
            return Err(crate::error::out_of_range(
                "refresh_every",
                0,
                "must be at least 1 (default 1024)",
            ));
        }
        Ok(())
    }
}

/// One pair kept in the sliding window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WindowEntry {
    pub x: Vec<f64>,
    pub u: f64,
    pub at: Timestamp,
    /// Squared errors of the context-free model and of the head on `u`, predicted before
    /// either learnt it (gated heads only; absent in state saved without the gate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub errors: Option<[f64; 2]>,
    /// `δ·(u − ū)`: the deviation from the mean the head predicted for `u`, times the one
    /// that came (gated heads only; absent in state saved before the signal test).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<f64>,
}

/// The prequential record of a gated head: each score predicted, before either learnt it,
/// by the head's mean score `ū` and by the centred head `ū + xᵀA⁻¹(b − ū·Σx)`, over the
/// same pairs as `A` and `b`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GateRecord {
    /// Pairs both models predicted.
    scored: f64,
    /// `Σ(u − ū)²` over them.
    free_error: f64,
    /// `Σ(u − ū − xᵀA⁻¹(b − ū·Σx))²` over them.
    context_error: f64,
    /// `Σδ·(u − ū)`, `δ = xᵀA⁻¹(b − ū·Σx)` the predicted deviation.
    #[serde(default)]
    cross: f64,
    /// `Σ(δ·(u − ū))²`.
    #[serde(default)]
    cross_sq: f64,
}

impl GateRecord {
    fn add(&mut self, errors: Option<[f64; 2]>, signal: Option<f64>, sign: f64) {
        if let Some([free, context]) = errors {
            self.scored += sign;
            self.free_error += sign * free;
            self.context_error += sign * context;
        }
        if let Some(c) = signal {
            self.cross += sign * c;
            self.cross_sq += sign * c * c;
        }
    }

    fn merge(&mut self, other: &GateRecord) {
        self.scored += other.scored;
        self.free_error += other.free_error;
        self.context_error += other.context_error;
        self.cross += other.cross;
        self.cross_sq += other.cross_sq;
    }

    /// `(Σδ·(u − ū), Σ(δ·(u − ū))²)`: the signal test's sums.
    #[must_use]
    pub fn signal(&self) -> (f64, f64) {
        (self.cross, self.cross_sq)
    }

    /// `(Σ free error, Σ context error, pairs scored)`.
    #[must_use]
    pub fn sums(&self) -> (f64, f64, f64) {
        (self.free_error, self.context_error, self.scored)
    }
}

/// Whether a contextual model whose prequential squared errors sum to `context` has saved
/// `margin` of a context-free one's `free` (the gate; nothing scored: no).
#[must_use]
pub fn context_wins(free: f64, context: f64, margin: f64) -> bool {
    free > 0.0 && context < (1.0 - margin) * free
}

/// Whether the deviations from the mean that contextual heads predicted are borne out by
/// the scores that came: `Σδ·(u − ū) > z·sqrt(Σ(δ·(u − ū))²)` and above rounding error (the gate's
/// signal test; nothing scored: no). Under no context effect each term has mean 0 given the past, so the sum
/// clears `z` of its own spread by chance only rarely; where the query moves the scores by
/// even a few hundredths it grows like `n` and its spread like `sqrt(n)`.
#[must_use]
pub fn signal_shown(cross: f64, cross_sq: f64, z: f64) -> bool {
    cross > SIGNAL_FLOOR && cross > z * cross_sq.sqrt()
}

/// The least `Σδ·(u − ū)` the signal test counts: rounding errors of scores that do not vary
/// at all must not open the gate.
const SIGNAL_FLOOR: f64 = 1e-9;

/// The sums behind a centred head, over the same pairs as `A` and `b`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Centre {
    /// `Σx`.
    sx: Vec<f64>,
    /// `Σu`.
    su: f64,
    /// `θ₁ = A⁻¹Σx`.
    theta_one: Vec<f64>,
}

impl Centre {
    fn new(dim: usize) -> Centre {
        Centre {
            sx: vec![0.0; dim],
            su: 0.0,
            theta_one: vec![0.0; dim],
        }
    }

    fn add(&mut self, x: &[f64], u: f64, sign: f64) {
        for (s, xi) in self.sx.iter_mut().zip(x) {
            *s += sign * xi;
        }
        self.su += sign * u;
    }
}

/// A centred head's estimate kept apart from it (after a detected drop, the level the
/// provider had): `xᵀθ + ū·(1 − xᵀθ₁)`, as the head predicted when it was kept.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RememberedLevel {
    /// `ū`.
    pub mean: f64,
    pub theta: Vec<f64>,
    pub theta_one: Vec<f64>,
}

impl RememberedLevel {
    /// The remembered estimate for `x`.
    #[must_use]
    pub fn estimate(&self, x: &[f64]) -> f64 {
        dot(&self.theta, x) + self.mean * (1.0 - dot(&self.theta_one, x))
    }
}

/// Per-provider ridge-regression state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinUcbHead {
    dim: usize,
    config: LinUcbConfig,
    /// `A = λr·I + Σ xxᵀ` over the window, packed, maintained incrementally.
    a: Vec<f64>,
    /// `A⁻¹`, packed upper triangle.
    a_inv: Vec<f64>,
    /// `A⁻¹` in single precision, refreshed after every update when `fast_width` is on.
    #[serde(skip)]
    a_inv_f32: Vec<f32>,
    b: Vec<f64>,
    theta: Vec<f64>,
    window: VecDeque<WindowEntry>,
    since_refresh: u32,
    refreshes: u64,
    /// Number of quality observations ever folded in.
    count: u64,
    /// The sums of a centred head (`config.center`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    centre: Option<Centre>,
    /// The prequential record of a gated head (`config.gate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gate: Option<GateRecord>,
    #[serde(skip)]
    scratch: Vec<f64>,
    /// The buffer of the last evicted pair, reused for the next one.
    #[serde(skip)]
    spare: Option<Vec<f64>>,
}

impl LinUcbHead {
    /// A fresh head of dimension `dim`.
    #[must_use]
    pub fn new(dim: usize, config: LinUcbConfig) -> LinUcbHead {
        let mut a = vec![0.0; packed_len(dim)];
        let mut a_inv = vec![0.0; packed_len(dim)];
        let mut diag = 0;
        for i in 0..dim {
            a[diag] = config.lambda_r;
            a_inv[diag] = 1.0 / config.lambda_r;
            diag += dim - i;
        }
        let a_inv_f32 = if config.fast_width {
            a_inv.iter().map(|&v| v as f32).collect()
        } else {
            Vec::new()
        };
        LinUcbHead {
            dim,
            config,
            a,
            a_inv,
            a_inv_f32,
            b: vec![0.0; dim],
            theta: vec![0.0; dim],
            window: VecDeque::new(),
            since_refresh: 0,
            refreshes: 0,
            count: 0,
            centre: (config.center || config.gate).then(|| Centre::new(dim)),
            gate: config.gate.then(GateRecord::default),
            scratch: vec![0.0; dim],
            spare: None,
        }
    }

    /// The head's parameters.
    #[must_use]
    pub fn config(&self) -> &LinUcbConfig {
        &self.config
    }

    /// Feature dimension.
    #[must_use]
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Quality observations folded in so far.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Pairs currently in the window.
    #[must_use]
    pub fn window_len(&self) -> usize {
        self.window.len()
    }

    /// `A⁻¹` as a full row-major matrix.
    #[must_use]
    pub fn a_inv(&self) -> Vec<f64> {
        packed_to_full(&self.a_inv, self.dim)
    }

    /// `A` as a full row-major matrix.
    #[must_use]
    pub fn a(&self) -> Vec<f64> {
        packed_to_full(&self.a, self.dim)
    }

    /// `A⁻¹` as a packed upper triangle (for [`super::linalg::dots`]).
    #[must_use]
    pub fn a_inv_packed(&self) -> &[f64] {
        &self.a_inv
    }

    /// `b`.
    #[must_use]
    pub fn b(&self) -> &[f64] {
        &self.b
    }

    /// The quality estimate `û = xᵀA⁻¹b` (centred: `xᵀθ + ū·(1 − xᵀθ₁)`).
    #[must_use]
    pub fn estimate(&self, x: &[f64]) -> f64 {
        self.estimate_with(|v| dot(v, x))
    }

    /// [`Self::estimate`] from the nonzero entries of `x` ([`super::linalg::nonzeros`]).
    #[must_use]
    pub fn estimate_sparse(&self, nz: &[(usize, f64)]) -> f64 {
        self.estimate_with(|v| dot_sparse(v, nz))
    }

    /// The estimate, given `v ↦ vᵀx`.
    fn estimate_with(&self, dot_x: impl Fn(&[f64]) -> f64) -> f64 {
        if self.config.center {
            self.centred_with(dot_x)
        } else {
            dot_x(&self.theta)
        }
    }

    /// `xᵀθ + ū·(1 − xᵀθ₁)` given `v ↦ vᵀx` (`xᵀθ` without the centre's sums).
    fn centred_with(&self, dot_x: impl Fn(&[f64]) -> f64) -> f64 {
        let u = dot_x(&self.theta);
        let pairs = self.pairs();
        match &self.centre {
            Some(c) if pairs > 0 => u + c.su / pairs as f64 * (1.0 - dot_x(&c.theta_one)),
            _ => u,
        }
    }

    /// The centred estimate `ū + xᵀA⁻¹(b − ū·Σx)` (the plain one without the centre's sums).
    #[must_use]
    pub fn centred_estimate(&self, x: &[f64]) -> f64 {
        self.centred_with(|v| dot(v, x))
    }

    /// The head's prediction of a score for `x` with the centre's sums, `None` without them:
    /// the centred estimate `ū + xᵀA⁻¹(b − ū·Σx)` (the change detector's reference).
    #[must_use]
    pub fn centred_prediction(&self, x: &[f64]) -> Option<f64> {
        self.centre.as_ref()?;
        Some(self.centred_estimate(x))
    }

    /// What the head predicts now, kept apart from it ([`RememberedLevel`]); `None` without
    /// the centre's sums or before any score.
    #[must_use]
    pub fn remember(&self) -> Option<RememberedLevel> {
        let c = self.centre.as_ref()?;
        let pairs = self.pairs();
        (pairs > 0).then(|| RememberedLevel {
            mean: c.su / pairs as f64,
            theta: self.theta.clone(),
            theta_one: c.theta_one.clone(),
        })
    }

    /// Keeps only the newest `n` pairs of the window (and counts only those): the evidence
    /// before a detected change is discarded. Without a window the head starts afresh.
    pub fn retain_newest(&mut self, n: usize) {
        if self.config.window.is_none() {
            *self = LinUcbHead::new(self.dim, self.config);
            return;
        }
        let drop = self.window.len().saturating_sub(n);
        self.window.drain(..drop);
        self.count = self.window.len() as u64;
        self.rebuild_from_window();
        self.refresh();
    }

    /// The scores of the window, oldest first.
    pub fn window_scores(&self) -> impl Iterator<Item = f64> + '_ {
        self.window.iter().map(|e| e.u)
    }

    /// The head's mean score `ū` (0 before any; `None` without the centre's sums).
    fn mean_score(&self) -> Option<f64> {
        let c = self.centre.as_ref()?;
        let pairs = self.pairs();
        Some(if pairs > 0 { c.su / pairs as f64 } else { 0.0 })
    }

    /// The context-free model of a gated head: the same ridge with one constant feature,
    /// `(û₀, width) = (Σu/(λr + n), 1/sqrt(λr + n))` over the head's `n` pairs; `None`
    /// without a gate.
    #[must_use]
    pub fn context_free(&self) -> Option<(f64, f64)> {
        self.gate.as_ref()?;
        let c = self.centre.as_ref()?;
        let a = self.config.lambda_r + self.pairs() as f64;
        Some((c.su / a, a.recip().sqrt()))
    }

    /// The prequential record of a gated head.
    #[must_use]
    pub fn gate_record(&self) -> Option<&GateRecord> {
        self.gate.as_ref()
    }

    /// [`Self::width_sq`] from the nonzero entries of `x`, in double precision whatever
    /// `fast_width` says (it is the cheaper path, not an approximation).
    #[must_use]
    pub fn width_sq_sparse(&self, nz: &[(usize, f64)]) -> f64 {
        let width_sq = if self.pristine() {
            // A⁻¹ is still I/λr (its first entry is the diagonal's value, bit for bit).
            let m = self.a_inv.first().copied().unwrap_or(0.0);
            scaled_identity_quad_form_sparse(m, self.dim, nz)
        } else {
            packed_quad_form_sparse(&self.a_inv, self.dim, nz)
        };
        width_sq.max(0.0)
    }

    /// Whether `A⁻¹` is still the `I/λr` it starts as: `A⁻¹` changes only when a pair is
    /// folded in (which counts it) or in a refresh (which is counted too, merges included).
    fn pristine(&self) -> bool {
        self.count == 0 && self.refreshes == 0
    }

    /// The pairs in `A` and `b`: the window's, or every one without a window.
    fn pairs(&self) -> u64 {
        match self.config.window {
            Some(_) => self.window.len() as u64,
            None => self.count,
        }
    }

    /// One recursive least-squares step of each solution kept: `θ ← θ + dir·sign·(u − xᵀθ)/den`,
    /// and the centre's `θ₁` the same with target 1.
    fn step_solutions(&mut self, x: &[f64], u: f64, sign: f64, den: f64, dir: &[f64]) {
        let step = sign * (u - dot(x, &self.theta)) / den;
        for (t, di) in self.theta.iter_mut().zip(dir) {
            *t += step * di;
        }
        if let Some(c) = &mut self.centre {
            let step = sign * (1.0 - dot(x, &c.theta_one)) / den;
            for (t, di) in c.theta_one.iter_mut().zip(dir) {
                *t += step * di;
            }
        }
    }

    /// `xᵀA⁻¹x`, the squared confidence width before scaling by α.
    #[must_use]
    pub fn width_sq(&self, x: &[f64]) -> f64 {
        packed_quad_form(&self.a_inv, x).max(0.0)
    }

    /// `A⁻¹` in single precision, packed, when `fast_width` is on (empty otherwise).
    #[must_use]
    pub fn a_inv_packed_f32(&self) -> &[f32] {
        &self.a_inv_f32
    }

    /// Whether rankings use the single-precision widths.
    #[must_use]
    pub fn fast_width(&self) -> bool {
        self.config.fast_width && self.a_inv_f32.len() == self.a_inv.len()
    }

    fn sync_f32(&mut self) {
        if self.config.fast_width {
            self.a_inv_f32.resize(self.a_inv.len(), 0.0);
            for (m, &v) in self.a_inv_f32.iter_mut().zip(&self.a_inv) {
                *m = v as f32;
            }
        }
    }

    /// `xᵀA⁻¹x` from `packed_outer(x)`: the fast path when several heads score one query.
    #[must_use]
    pub fn width_sq_outer(&self, outer: &[f64]) -> f64 {
        dot(&self.a_inv, outer).max(0.0)
    }

    /// Folds in the pair (x, u) observed at `at`, downdating the oldest pair when the window
    /// overflows.
    pub fn update(&mut self, x: &[f64], u: f64, at: Timestamp) {
        // Prequential: both models predict u before either learns it.
        let (errors, signal) = match (&self.gate, self.mean_score()) {
            (Some(_), Some(mean)) => {
                let free = u - mean;
                let deviation = self.centred_with(|v| dot(v, x)) - mean;
                let context = free - deviation;
                (
                    Some([free * free, context * context]),
                    Some(deviation * free),
                )
            }
            _ => (None, None),
        };
        self.count += 1;
        if let Some(g) = &mut self.gate {
            g.add(errors, signal, 1.0);
        }
        self.update_inner(x, u, at, errors, signal);
        self.sync_f32();
    }

    fn update_inner(
        &mut self,
        x: &[f64],
        u: f64,
        at: Timestamp,
        errors: Option<[f64; 2]>,
        signal: Option<f64>,
    ) {
        let Some(w) = self.config.window else {
            self.rank_one(x, u, 1.0);
            return;
        };
        let mut buf = self.spare.take().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(x);
        self.window.push_back(WindowEntry {
            x: buf,
            u,
            at,
            errors,
            signal,
        });
        if self.window.len() <= w {
            self.rank_one(x, u, 1.0);
            return;
        }
        // A full window: add the new pair and remove the oldest in one fused rank-two step.
        if let Some(old) = self.window.pop_front() {
            if let Some(g) = &mut self.gate {
                g.add(old.errors, old.signal, -1.0);
            }
            self.replace(x, u, &old.x, old.u);
            self.spare = Some(old.x);
        }
    }

    /// Adds (x, u) and removes (xo, uo): two Sherman–Morrison steps fused so that `A⁻¹` is
    /// read once and written once.
    fn replace(&mut self, x: &[f64], u: f64, xo: &[f64], uo: f64) {
        let d = self.dim;
        if self.scratch.len() != 2 * d {
            self.scratch = vec![0.0; 2 * d];
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let (v, wv) = scratch.split_at_mut(d);
        packed_mat_vec2(&self.a_inv, x, xo, v, wv);
        // Insert: den1 = 1 + xᵀA⁻¹x; θ1 = θ + v·(u − xᵀθ)/den1; A1⁻¹ = A⁻¹ − vvᵀ/den1.
        let den1 = 1.0 + dot(x, v);
        self.step_solutions(x, u, 1.0, den1, v);
        // w = A1⁻¹xo = A⁻¹xo − v·(vᵀxo)/den1.
        let c = dot(v, xo) / den1;
        for (wi, vi) in wv.iter_mut().zip(v.iter()) {
            *wi -= c * vi;
        }
        // Remove: den2 = 1 − xoᵀA1⁻¹xo; θ2 = θ1 + w·(xoᵀθ1 − uo)/den2; A2⁻¹ = A1⁻¹ + wwᵀ/den2.
        let den2 = 1.0 - dot(xo, wv);
        packed_rank_two(&mut self.a, x, 1.0, xo, -1.0);
        for ((bi, xi), oi) in self.b.iter_mut().zip(x).zip(xo) {
            *bi += u * xi - uo * oi;
        }
        if let Some(c) = &mut self.centre {
            c.add(x, u, 1.0);
            c.add(xo, uo, -1.0);
        }
        if den2 <= 1e-12 {
            // Only reachable through accumulated error: recompute instead.
            self.scratch = scratch;
            self.refresh();
            return;
        }
        self.step_solutions(xo, uo, -1.0, den2, wv);
        packed_rank_two(&mut self.a_inv, v, -1.0 / den1, wv, 1.0 / den2);
        self.scratch = scratch;
        self.since_refresh += 2;
        if self.since_refresh >= self.config.refresh_every {
            self.refresh();
        }
    }

    /// Adds (`sign = 1`) or removes (`sign = −1`) the pair (x, u).
    fn rank_one(&mut self, x: &[f64], u: f64, sign: f64) {
        if self.scratch.len() != 2 * self.dim {
            self.scratch = vec![0.0; 2 * self.dim];
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let v = &mut scratch[..self.dim];
        packed_mat_vec(&self.a_inv, x, v);
        let s = dot(x, v);
        let den = 1.0 + sign * s;
        self.apply_to_a(x, u, sign);
        if den <= 1e-12 {
            // Only reachable through accumulated error on a downdate: recompute instead.
            self.scratch = scratch;
            self.refresh();
            return;
        }
        // θ ← θ ± v·(u − xᵀθ)/(1 ± s): the recursive least-squares step matching the update.
        self.step_solutions(x, u, sign, den, v);
        packed_rank_one(&mut self.a_inv, v, -sign / den);
        self.scratch = scratch;
        self.since_refresh += 1;
        if self.since_refresh >= self.config.refresh_every {
            self.refresh();
        }
    }

    fn apply_to_a(&mut self, x: &[f64], u: f64, sign: f64) {
        packed_rank_one(&mut self.a, x, sign);
        for (bi, xi) in self.b.iter_mut().zip(x) {
            *bi += sign * u * xi;
        }
        if let Some(c) = &mut self.centre {
            c.add(x, u, sign);
        }
    }

    /// Recomputes `A⁻¹` and `θ` from `A` and `b` (guards against accumulated error).
    pub fn refresh(&mut self) {
        let d = self.dim;
        self.refreshes += 1;
        if self.config.window.is_some() && self.refreshes.is_multiple_of(16) {
            // A and b are λr·I + Σ xxᵀ and Σ u·x over the window: now and then rebuild both
            // exactly, so that additions and removals cannot drift either.
            self.rebuild_from_window();
        }
        if let Some(inv) = spd_inverse(&packed_to_full(&self.a, d), d) {
            self.a_inv = full_to_packed(&inv, d);
        }
        let mut theta = vec![0.0; d];
        packed_mat_vec(&self.a_inv, &self.b, &mut theta);
        self.theta = theta;
        if let Some(c) = &mut self.centre {
            packed_mat_vec(&self.a_inv, &c.sx, &mut c.theta_one);
        }
        self.since_refresh = 0;
        self.sync_f32();
    }

    /// Sets `A`, `b` (and the centre's sums) exactly from the pairs in the window.
    fn rebuild_from_window(&mut self) {
        let d = self.dim;
        let mut a = vec![0.0; packed_len(d)];
        let mut diag = 0;
        for i in 0..d {
            a[diag] = self.config.lambda_r;
            diag += d - i;
        }
        let mut b = vec![0.0; d];
        let mut centre = (self.config.center || self.config.gate).then(|| Centre::new(d));
        let mut gate = self.config.gate.then(GateRecord::default);
        for e in &self.window {
            packed_rank_one(&mut a, &e.x, 1.0);
            for (bi, xi) in b.iter_mut().zip(&e.x) {
                *bi += e.u * xi;
            }
            if let Some(c) = &mut centre {
                c.add(&e.x, e.u, 1.0);
            }
            if let Some(g) = &mut gate {
                g.add(e.errors, e.signal, 1.0);
            }
        }
        self.a = a;
        self.b = b;
        self.centre = centre;
        self.gate = gate;
    }

    /// Adds another instance's head: the head of the union of both observation streams.
    /// With a window, the union is ordered by time and only the newest `W` pairs are kept.
    ///
    /// # Errors
    /// Different dimensions or configurations.
    pub fn merge(&mut self, other: &LinUcbHead) -> Result<(), crate::StateError> {
        // The gate and the warm-up's order decide, they do not shape the state: heads saved
        // with or without them merge.
        let gate_as_here = LinUcbConfig {
            gate: self.config.gate,
            gate_margin: self.config.gate_margin,
            gate_z: self.config.gate_z,
            gate_retry: self.config.gate_retry,
            gate_tie_z: self.config.gate_tie_z,
            warmup_order: self.config.warmup_order,
            ..other.config
        };
        if other.dim != self.dim || gate_as_here != self.config {
            return Err(crate::StateError::Shape {
                what: format!(
                    "quality head dimension {} vs {} or different lambda_r/window/center",
                    self.dim, other.dim
                ),
            });
        }
        let fits = |c: &Centre| c.sx.len() == self.dim && c.theta_one.len() == self.dim;
        if other.config.center && !other.centre.as_ref().is_some_and(fits) {
            return Err(crate::StateError::Shape {
                what: format!(
                    "a centred quality head of dimension {} without its sums (Σx, Σu)",
                    self.dim
                ),
            });
        }
        if other.count == 0 && other.window.is_empty() {
            return Ok(());
        }
        if self.count == 0 && self.window.is_empty() {
            // Nothing here: the union is the other head, window order included.
            let config = self.config;
            self.clone_from(other);
            self.config = config;
            self.adopt_gate(other, None, true);
            return Ok(());
        }
        self.count += other.count;
        let here = self.gate.take();
        self.adopt_gate(other, here, false);
        if let Some(w) = self.config.window {
            let mut all: Vec<WindowEntry> = self.window.drain(..).collect();
            all.extend(other.window.iter().cloned());
            all.sort_by(|p, q| p.at.0.total_cmp(&q.at.0));
            let skip = all.len().saturating_sub(w);
            self.window = all.into_iter().skip(skip).collect();
            self.rebuild_from_window();
        } else {
            // Both sides carry the prior λr·I; the union carries it once.
            let mut diag = 0;
            for i in 0..self.dim {
                self.a[diag] -= self.config.lambda_r;
                diag += self.dim - i;
            }
            for (a, oa) in self.a.iter_mut().zip(&other.a) {
                *a += oa;
            }
            for (b, ob) in self.b.iter_mut().zip(&other.b) {
                *b += ob;
            }
            if let (Some(c), Some(oc)) = (&mut self.centre, &other.centre) {
                for (s, os) in c.sx.iter_mut().zip(&oc.sx) {
                    *s += os;
                }
                c.su += oc.su;
            }
        }
        self.refresh();
        Ok(())
    }

    /// Sets this head's gate (its record, and the centre's sums it needs) after `other` was
    /// merged in, `here` being this head's record before; `copied` when this head was empty
    /// and is now a copy of `other`. With a window both are recomputed from the window's
    /// pairs (by the merge's rebuild, or here for a copy). Without one the records add; a
    /// windowless head saved without a gate cannot be summed pair by pair, and the union then
    /// ranks with its contextual estimate (no gate).
    fn adopt_gate(&mut self, other: &LinUcbHead, here: Option<GateRecord>, copied: bool) {
        if !self.config.gate {
            self.gate = None;
            if !self.config.center {
                self.centre = None;
            }
            return;
        }
        if self.config.window.is_some() {
            if copied && other.gate.is_none() {
                self.rebuild_from_window();
                self.refresh();
            }
            return;
        }
        self.gate = match (here, &other.gate) {
            (Some(mut g), Some(o)) => {
                g.merge(o);
                Some(g)
            }
            (None, Some(o)) if copied => Some(o.clone()),
            (here, None) if other.count == 0 => here,
            _ => None,
        };
        if self.gate.is_none() && !self.config.center {
            self.centre = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_heads_sparse_width_is_the_general_forms_to_the_bit() {
        use crate::estimators::linalg::nonzeros;
        let dim = 12;
        for lambda_r in [1.0, 0.3, 2.5] {
            let config = LinUcbConfig {
                lambda_r,
                ..LinUcbConfig::default()
            };
            let fresh = LinUcbHead::new(dim, config);
            let mut used = LinUcbHead::new(dim, config);
            used.update(&vec![0.0; dim], 0.5, Timestamp(0.0));
            // Queries with a few nonzero features of either sign, one beyond the head's
            // dimension (a longer x counts its tail as zero).
            for seed in 0..50_u32 {
                let mut x = vec![0.0; dim + 2];
                for (k, v) in x.iter_mut().enumerate() {
                    let h = (seed * 31 + k as u32 * 17) % 7;
                    if h < 3 {
                        *v = (f64::from(h) - 1.3) * (1.0 + f64::from(seed) / 7.0);
                    }
                }
                x[dim + 1] = 0.7;
                let nz = nonzeros(&x, x.len()).unwrap();
                let general = packed_quad_form_sparse(&fresh.a_inv, dim, &nz).max(0.0);
                assert!(fresh.pristine());
                assert_eq!(fresh.width_sq_sparse(&nz).to_bits(), general.to_bits());
                // A head that learnt (even from an all-zero query) is read the general way.
                assert!(!used.pristine());
                let learnt = packed_quad_form_sparse(&used.a_inv, dim, &nz).max(0.0);
                assert_eq!(used.width_sq_sparse(&nz).to_bits(), learnt.to_bits());
            }
        }
        // A merge that brings pairs is no longer pristine; one that brings none changes nothing.
        let mut merged = LinUcbHead::new(dim, LinUcbConfig::default());
        merged
            .merge(&LinUcbHead::new(dim, LinUcbConfig::default()))
            .unwrap();
        assert!(merged.pristine());
        let mut other = LinUcbHead::new(dim, LinUcbConfig::default());
        let mut x = vec![0.0; dim];
        x[3] = 1.0;
        x[5] = -0.5;
        other.update(&x, 0.9, Timestamp(0.0));
        merged.merge(&other).unwrap();
        assert!(!merged.pristine());
        let nz = nonzeros(&x, dim).unwrap();
        assert!(
            merged.width_sq_sparse(&nz)
                < LinUcbHead::new(dim, LinUcbConfig::default()).width_sq_sparse(&nz)
        );
    }

    #[test]
    fn one_update_by_hand() {
        // d = 2, λr = 1, x = (1, 0), u = 0.5: A = diag(2, 1), b = (0.5, 0), θ = (0.25, 0).
        let mut h = LinUcbHead::new(2, LinUcbConfig::default());
        h.update(&[1.0, 0.0], 0.5, Timestamp(0.0));
        let inv = h.a_inv();
        assert!((inv[0] - 0.5).abs() < 1e-15 && (inv[3] - 1.0).abs() < 1e-15);
        assert!((h.estimate(&[1.0, 0.0]) - 0.25).abs() < 1e-15);
        assert!((h.width_sq(&[1.0, 0.0]) - 0.5).abs() < 1e-15);
        assert!((h.width_sq(&[0.0, 1.0]) - 1.0).abs() < 1e-15);
    }

    /// `ū + xᵀA⁻¹(b − ū·Σx)` computed from the pairs directly.
    fn centred_by_hand(pairs: &[(Vec<f64>, f64)], x: &[f64], lambda: f64) -> f64 {
        let d = x.len();
        let mut a = vec![0.0; d * d];
        for i in 0..d {
            a[i * d + i] = lambda;
        }
        let mut b = vec![0.0; d];
        let mut sx = vec![0.0; d];
        let mut su = 0.0;
        for (p, u) in pairs {
            for i in 0..d {
                for j in 0..d {
                    a[i * d + j] += p[i] * p[j];
                }
                b[i] += u * p[i];
                sx[i] += p[i];
            }
            su += u;
        }
        let mean = su / pairs.len() as f64;
        let inv = super::super::linalg::spd_inverse(&a, d).unwrap();
        let r: Vec<f64> = b.iter().zip(&sx).map(|(bi, si)| bi - mean * si).collect();
        let w: Vec<f64> = (0..d).map(|i| dot(&inv[i * d..(i + 1) * d], &r)).collect();
        mean + dot(&w, x)
    }

    fn unit(v: &[f64]) -> Vec<f64> {
        let n = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        v.iter().map(|a| a / n).collect()
    }

    #[test]
    fn centred_estimate_matches_its_definition_through_window_updates_and_refreshes() {
        let cfg = LinUcbConfig {
            window: Some(7),
            refresh_every: 5,
            center: true,
            ..LinUcbConfig::default()
        };
        let mut h = LinUcbHead::new(3, cfg);
        let mut pairs = Vec::new();
        for t in 0..40u32 {
            let f = f64::from(t);
            let x = unit(&[1.0, (f * 0.7).sin(), (f * 1.3).cos()]);
            let u = 0.5 + 0.4 * (f * 0.3).sin();
            h.update(&x, u, Timestamp(f));
            pairs.push((x, u));
            let kept = &pairs[pairs.len().saturating_sub(7)..];
            for q in [[1.0, 0.0, 0.0], [0.2, -0.9, 0.4], [0.0, 0.0, 1.0]] {
                let q = unit(&q);
                let want = centred_by_hand(kept, &q, 1.0);
                let got = h.estimate(&q);
                assert!((got - want).abs() < 1e-9, "t {t}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn a_centred_head_estimates_an_unseen_context_at_the_mean_score() {
        // Four scored contexts, each on its own feature; the fifth feature was never seen.
        let mut plain = LinUcbHead::new(5, LinUcbConfig::default());
        let mut centred = LinUcbHead::new(
            5,
            LinUcbConfig {
                center: true,
                ..LinUcbConfig::default()
            },
        );
        for i in 0..4 {
            let mut x = [0.0; 5];
            x[i] = 1.0;
            plain.update(&x, 0.6, Timestamp(0.0));
            centred.update(&x, 0.6, Timestamp(0.0));
        }
        let unseen = [0.0, 0.0, 0.0, 0.0, 1.0];
        assert!(plain.estimate(&unseen).abs() < 1e-12);
        assert!((centred.estimate(&unseen) - 0.6).abs() < 1e-12);
        // A seen context: the ridge's shrink (0.6/2) is filled in by the mean.
        assert!((plain.estimate(&[1.0, 0.0, 0.0, 0.0, 0.0]) - 0.3).abs() < 1e-12);
        assert!((centred.estimate(&[1.0, 0.0, 0.0, 0.0, 0.0]) - 0.6).abs() < 1e-12);
        // Before any score the mean is unknown: 0, as for the plain head.
        let fresh = LinUcbHead::new(5, centred.config);
        assert!(fresh.estimate(&unseen).abs() < 1e-15);
    }

    #[test]
    fn merged_centred_heads_equal_one_head_fed_both_streams() {
        for window in [None, Some(6)] {
            let cfg = LinUcbConfig {
                window,
                center: true,
                ..LinUcbConfig::default()
            };
            let (mut left, mut right, mut both) = (
                LinUcbHead::new(2, cfg),
                LinUcbHead::new(2, cfg),
                LinUcbHead::new(2, cfg),
            );
            for t in 0..10u32 {
                let f = f64::from(t);
                let x = unit(&[1.0, f.sin()]);
                let u = 0.3 + 0.05 * f;
                if t % 3 == 0 {
                    right.update(&x, u, Timestamp(f));
                } else {
                    left.update(&x, u, Timestamp(f));
                }
                both.update(&x, u, Timestamp(f));
            }
            left.merge(&right).unwrap();
            for q in [[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]] {
                let (m, b) = (left.estimate(&q), both.estimate(&q));
                assert!((m - b).abs() < 1e-9, "window {window:?}: {m} vs {b}");
            }
        }
    }

    #[test]
    fn centring_is_part_of_the_state_and_written_out_only_when_on() {
        let plain = LinUcbHead::new(2, LinUcbConfig::default());
        let text = serde_json::to_string(&plain).unwrap();
        assert!(
            !text.contains("center") && !text.contains("centre"),
            "{text}"
        );
        let cfg = LinUcbConfig {
            center: true,
            ..LinUcbConfig::default()
        };
        let mut centred = LinUcbHead::new(2, cfg);
        centred.update(&[1.0, 0.0], 0.7, Timestamp(0.0));
        let back: LinUcbHead =
            serde_json::from_str(&serde_json::to_string(&centred).unwrap()).unwrap();
        assert_eq!(back.centre, centred.centre);
        assert_eq!(back.config, cfg);
        assert!((back.estimate(&[0.0, 1.0]) - 0.7).abs() < 1e-15);
        // Heads of different centring do not merge; nor a centred head stripped of its sums.
        let err = plain.clone().merge(&centred).unwrap_err().to_string();
        assert!(err.contains("center"), "{err}");
        let mut stripped = centred.clone();
        stripped.centre = None;
        let err = centred.clone().merge(&stripped).unwrap_err().to_string();
        assert!(err.contains("without its sums"), "{err}");
    }

    #[test]
    fn window_downdate_returns_to_the_prior() {
        let cfg = LinUcbConfig {
            window: Some(1),
            ..LinUcbConfig::default()
        };
        let mut h = LinUcbHead::new(2, cfg);
        h.update(&[1.0, 0.0], 0.5, Timestamp(0.0));
        h.update(&[0.0, 1.0], 1.0, Timestamp(1.0));
        // Only the second pair remains: A = diag(1, 2), b = (0, 1).
        let inv = h.a_inv();
        assert!((inv[0] - 1.0).abs() < 1e-12 && (inv[3] - 0.5).abs() < 1e-12);
        assert!(h.estimate(&[1.0, 0.0]).abs() < 1e-12);
        assert!((h.estimate(&[0.0, 1.0]) - 0.5).abs() < 1e-12);
    }

    fn gated(window: Option<usize>) -> LinUcbConfig {
        LinUcbConfig {
            window,
            gate: true,
            ..LinUcbConfig::default()
        }
    }

    #[test]
    fn the_gate_record_is_prequential_by_hand() {
        // d = 2, λr = 1. Each score is predicted by ū and by ū + xᵀA⁻¹(b − ū·Σx) first.
        let mut h = LinUcbHead::new(2, gated(None));
        // Nothing learnt: both predict 0, both errors (0.5)².
        h.update(&[1.0, 0.0], 0.5, Timestamp(0.0));
        // ū = 0.5; A = diag(2, 1), θ₁ = A⁻¹(1, 0) = (0.5, 0): at (0, 1) the centred head
        // says 0 + 0.5·(1 − 0) = 0.5 as the mean does; both errors (0.4)².
        h.update(&[0.0, 1.0], 0.9, Timestamp(1.0));
        // ū = 0.7; A = diag(2, 2), θ = (0.25, 0.45), θ₁ = (0.5, 0.5): at (1, 0) the centred
        // head says 0.25 + 0.7·0.5 = 0.6 (error 0.01), the mean 0.7 (error 0.04).
        h.update(&[1.0, 0.0], 0.5, Timestamp(2.0));
        let (free, context, scored) = h.gate_record().unwrap().sums();
        assert!((free - 0.45).abs() < 1e-12, "{free}");
        assert!((context - 0.42).abs() < 1e-12, "{context}");
        assert!((scored - 3.0).abs() < 1e-12);
        assert!(context_wins(free, context, 0.05) && !context_wins(free, context, 0.1));
        // The context-free model: Σu/(λr + n) = 1.9/4, width 1/sqrt(4).
        let (u0, w0) = h.context_free().unwrap();
        assert!((u0 - 0.475).abs() < 1e-12 && (w0 - 0.5).abs() < 1e-12);
        // The gate does not change the head's own estimate (uncentred: A = diag(3, 2),
        // b = (1, 0.9), so 1/3 at (1, 0)).
        assert!((h.estimate(&[1.0, 0.0]) - 1.0 / 3.0).abs() < 1e-12);
        assert!(LinUcbHead::new(2, LinUcbConfig::default())
            .context_free()
            .is_none());
    }

    #[test]
    fn gate_records_merge_by_adding_and_restore_from_state_saved_without_them() {
        let pairs: Vec<([f64; 2], f64)> = (0..5u32)
            .map(|t| {
                let f = f64::from(t);
                (unit2(1.0, f.sin()), 0.3 + 0.1 * f)
            })
            .collect();
        for window in [None, Some(10)] {
            let (mut left, mut right) = (
                LinUcbHead::new(2, gated(window)),
                LinUcbHead::new(2, gated(window)),
            );
            for (t, (x, u)) in pairs.iter().enumerate() {
                let side = if t % 2 == 0 { &mut left } else { &mut right };
                side.update(x, *u, Timestamp(t as f64));
            }
            let (lf, lc, ls) = left.gate_record().unwrap().sums();
            let (rf, rc, rs) = right.gate_record().unwrap().sums();
            let (lx, lx2) = left.gate_record().unwrap().signal();
            let (rx, rx2) = right.gate_record().unwrap().signal();
            // The right side saw two pairs: after one, δ = 0. The left side saw three.
            assert!(lx2 > 0.0 && rx2.abs() < 1e-12, "{lx2} {rx2}");
            left.merge(&right).unwrap();
            let (f, c, s) = left.gate_record().unwrap().sums();
            assert!((f - lf - rf).abs() < 1e-12 && (c - lc - rc).abs() < 1e-12);
            let (x, x2) = left.gate_record().unwrap().signal();
            assert!((x - lx - rx).abs() < 1e-12 && (x2 - lx2 - rx2).abs() < 1e-12);
            assert!((s - ls - rs).abs() < 1e-12 && (s - 5.0).abs() < 1e-12);
            let (u0, _) = left.context_free().unwrap();
            assert!((u0 - 2.5 / 6.0).abs() < 1e-12, "window {window:?}: {u0}");
            // Written out and read back: the same record and the same context-free model.
            let back: LinUcbHead =
                serde_json::from_str(&serde_json::to_string(&left).unwrap()).unwrap();
            let (bf, bc, bs) = back.gate_record().unwrap().sums();
            assert!((bf - f).abs() < 1e-12 && (bc - c).abs() < 1e-12 && (bs - s).abs() < 1e-12);
            let (bx, bx2) = back.gate_record().unwrap().signal();
            assert!((bx - x).abs() < 1e-12 && (bx2 - x2).abs() < 1e-12);
            let (bu, bw) = back.context_free().unwrap();
            assert!((bu - u0).abs() < 1e-12 && (bw - 6f64.recip().sqrt()).abs() < 1e-12);
        }
        // A head saved without the gate (an earlier release) has no record and no "gate".
        let mut plain = LinUcbHead::new(2, LinUcbConfig::default());
        for (t, (x, u)) in pairs.iter().enumerate() {
            plain.update(x, *u, Timestamp(t as f64));
        }
        let text = serde_json::to_string(&plain).unwrap();
        assert!(!text.contains("gate"), "{text}");
        let saved: LinUcbHead = serde_json::from_str(&text).unwrap();
        // Restored into a gated head: with a window its mean comes back from the pairs and
        // nothing counts as scored; without one it cannot, and the head is not gated.
        let mut restored = LinUcbHead::new(2, gated(Some(2000)));
        restored.merge(&saved).unwrap();
        assert!(restored.gate_record().unwrap().sums().2.abs() < 1e-12);
        let (u0, w0) = restored.context_free().unwrap();
        assert!((u0 - 2.5 / 6.0).abs() < 1e-12 && (w0 - 6f64.recip().sqrt()).abs() < 1e-12);
        assert!((restored.estimate(&[1.0, 0.0]) - saved.estimate(&[1.0, 0.0])).abs() < 1e-9);
        let mut windowless = LinUcbHead::new(2, gated(None));
        let mut old = LinUcbHead::new(
            2,
            LinUcbConfig {
                window: None,
                ..LinUcbConfig::default()
            },
        );
        old.update(&[1.0, 0.0], 0.5, Timestamp(0.0));
        windowless.merge(&old).unwrap();
        assert!(windowless.gate_record().is_none() && windowless.context_free().is_none());
    }

    #[test]
    fn a_gate_margin_outside_its_range_is_an_error_naming_it() {
        for margin in [1.0, -0.1] {
            let err = LinUcbConfig {
                gate: true,
                gate_margin: margin,
                ..LinUcbConfig::default()
            }
            .validate()
            .unwrap_err()
            .to_string();
            assert!(
                err.contains("gate_margin") && err.contains("[0, 1)"),
                "{err}"
            );
        }
    }

    fn unit2(a: f64, b: f64) -> [f64; 2] {
        let n = (a * a + b * b).sqrt();
        [a / n, b / n]
    }
}
