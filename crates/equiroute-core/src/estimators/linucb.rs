//! A LinUCB quality head: ridge regression of quality on query features, kept as `A⁻¹`.
//!
//! - Init: `A = λr·I`, `b = 0`.
//! - Update with (x, u): Sherman–Morrison `A⁻¹ ← A⁻¹ − (A⁻¹x)(A⁻¹x)ᵀ/(1 + xᵀA⁻¹x)`, `b += u·x`.
//! - Sliding window of the last `W` pairs: when it overflows, the oldest pair is *downdated*
//!   the same way with the opposite sign (`A⁻¹ ← A⁻¹ + vvᵀ/(1 − xᵀA⁻¹x)`, `b −= u·x`).
//! - `θ = A⁻¹b` is maintained alongside by the matching recursive-least-squares step, so the
//!   estimate `û = xᵀθ` costs O(d) at decision time; the width `xᵀA⁻¹x` costs O(d²).
//! - Numerics: after 10⁶ rank-one steps the error in `A⁻¹` adds up, so every
//!   `refresh_every` updates `A⁻¹` is recomputed from `A` (kept exactly as
//!   `λr·I + Σ xxᵀ` over the window) by a Cholesky inverse, and `θ` from `b`.

use super::linalg::{dot, mat_vec, rank_one_update, spd_inverse, symmetrize};
use crate::decision::Timestamp;
use serde::{Deserialize, Serialize};

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
}

impl Default for LinUcbConfig {
    fn default() -> Self {
        LinUcbConfig {
            lambda_r: 1.0,
            window: Some(2000),
            refresh_every: 1024,
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
}

/// Per-provider ridge-regression state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinUcbHead {
    dim: usize,
    config: LinUcbConfig,
    /// `A = λr·I + Σ xxᵀ` over the window.
    a: Vec<f64>,
    a_inv: Vec<f64>,
    b: Vec<f64>,
    theta: Vec<f64>,
    window: std::collections::VecDeque<WindowEntry>,
    since_refresh: u32,
    /// Number of quality observations ever folded in.
    count: u64,
    #[serde(skip)]
    scratch: Vec<f64>,
}

impl LinUcbHead {
    /// A fresh head of dimension `dim`.
    #[must_use]
    pub fn new(dim: usize, config: LinUcbConfig) -> LinUcbHead {
        let mut a = vec![0.0; dim * dim];
        let mut a_inv = vec![0.0; dim * dim];
        for i in 0..dim {
            a[i * dim + i] = config.lambda_r;
            a_inv[i * dim + i] = 1.0 / config.lambda_r;
        }
        LinUcbHead {
            dim,
            config,
            a,
            a_inv,
            b: vec![0.0; dim],
            theta: vec![0.0; dim],
            window: std::collections::VecDeque::new(),
            since_refresh: 0,
            count: 0,
            scratch: vec![0.0; dim],
        }
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

    /// `A⁻¹`, row-major.
    #[must_use]
    pub fn a_inv(&self) -> &[f64] {
        &self.a_inv
    }

    /// `A`, row-major.
    #[must_use]
    pub fn a(&self) -> &[f64] {
        &self.a
    }

    /// `b`.
    #[must_use]
    pub fn b(&self) -> &[f64] {
        &self.b
    }

    /// The quality estimate `û = xᵀA⁻¹b`.
    #[must_use]
    pub fn estimate(&self, x: &[f64]) -> f64 {
        dot(&self.theta, x)
    }

    /// `xᵀA⁻¹x`, the squared confidence width before scaling by α.
    #[must_use]
    pub fn width_sq(&self, x: &[f64]) -> f64 {
        let d = self.dim;
        let mut s = 0.0;
        for (row, &xi) in self.a_inv.chunks_exact(d).zip(x) {
            s += xi * dot(row, x);
        }
        s.max(0.0)
    }

    /// Folds in the pair (x, u) observed at `at`, downdating the oldest pair when the window
    /// overflows.
    pub fn update(&mut self, x: &[f64], u: f64, at: Timestamp) {
        self.rank_one(x, u, 1.0);
        self.count += 1;
        if let Some(w) = self.config.window {
            self.window.push_back(WindowEntry {
                x: x.to_vec(),
                u,
                at,
            });
            while self.window.len() > w {
                if let Some(old) = self.window.pop_front() {
                    self.rank_one(&old.x, old.u, -1.0);
                }
            }
        }
    }

    /// Adds (`sign = 1`) or removes (`sign = −1`) the pair (x, u).
    fn rank_one(&mut self, x: &[f64], u: f64, sign: f64) {
        if self.scratch.len() != self.dim {
            self.scratch = vec![0.0; self.dim];
        }
        let mut v = std::mem::take(&mut self.scratch);
        mat_vec(&self.a_inv, x, &mut v);
        let s = dot(x, &v);
        let den = 1.0 + sign * s;
        if den <= 1e-12 {
            // Only reachable through accumulated error on a downdate: recompute instead.
            self.scratch = v;
            self.apply_to_a(x, u, sign);
            self.refresh();
            return;
        }
        // θ ← θ ± v·(u − xᵀθ)/(1 ± s): the recursive least-squares step matching the update.
        let err = u - dot(x, &self.theta);
        let step = sign * err / den;
        for (t, vi) in self.theta.iter_mut().zip(&v) {
            *t += step * vi;
        }
        rank_one_update(&mut self.a_inv, &v, -sign / den);
        self.scratch = v;
        self.apply_to_a(x, u, sign);
        self.since_refresh += 1;
        if self.since_refresh >= self.config.refresh_every {
            self.refresh();
        }
    }

    fn apply_to_a(&mut self, x: &[f64], u: f64, sign: f64) {
        rank_one_update(&mut self.a, x, sign);
        for (bi, xi) in self.b.iter_mut().zip(x) {
            *bi += sign * u * xi;
        }
    }

    /// Recomputes `A⁻¹` and `θ` from `A` and `b` (guards against accumulated error).
    pub fn refresh(&mut self) {
        let d = self.dim;
        symmetrize(&mut self.a, d);
        if self.config.window.is_some() {
            // A is λr·I + Σ xxᵀ over the window: rebuild it exactly while we are here.
            self.rebuild_from_window();
        }
        if let Some(inv) = spd_inverse(&self.a, d) {
            self.a_inv = inv;
        }
        let mut theta = vec![0.0; d];
        mat_vec(&self.a_inv, &self.b, &mut theta);
        self.theta = theta;
        self.since_refresh = 0;
    }

    fn rebuild_from_window(&mut self) {
        let d = self.dim;
        self.a.fill(0.0);
        for i in 0..d {
            self.a[i * d + i] = self.config.lambda_r;
        }
        self.b.fill(0.0);
        for e in &self.window {
            rank_one_update(&mut self.a, &e.x, 1.0);
            for (bi, xi) in self.b.iter_mut().zip(&e.x) {
                *bi += e.u * xi;
            }
        }
    }

    /// Adds another instance's head: the head of the union of both observation streams.
    /// With a window, the union is ordered by time and only the newest `W` pairs are kept.
    ///
    /// # Errors
    /// Different dimensions or configurations.
    pub fn merge(&mut self, other: &LinUcbHead) -> Result<(), crate::StateError> {
        if other.dim != self.dim || other.config != self.config {
            return Err(crate::StateError::Shape {
                what: format!(
                    "quality head dimension {} vs {} or different lambda_r/window",
                    self.dim, other.dim
                ),
            });
        }
        self.count += other.count;
        if let Some(w) = self.config.window {
            let mut all: Vec<WindowEntry> = self.window.drain(..).collect();
            all.extend(other.window.iter().cloned());
            all.sort_by(|p, q| p.at.0.total_cmp(&q.at.0));
            let skip = all.len().saturating_sub(w);
            self.window = all.into_iter().skip(skip).collect();
        } else {
            let d = self.dim;
            for (i, (a, oa)) in self.a.iter_mut().zip(&other.a).enumerate() {
                *a += oa
                    - if i % (d + 1) == 0 {
                        self.config.lambda_r
                    } else {
                        0.0
                    };
            }
            for (b, ob) in self.b.iter_mut().zip(&other.b) {
                *b += ob;
            }
        }
        self.refresh();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_update_by_hand() {
        // d = 2, λr = 1, x = (1, 0), u = 0.5: A = diag(2, 1), b = (0.5, 0), θ = (0.25, 0).
        let mut h = LinUcbHead::new(2, LinUcbConfig::default());
        h.update(&[1.0, 0.0], 0.5, Timestamp(0.0));
        assert!((h.a_inv()[0] - 0.5).abs() < 1e-15 && (h.a_inv()[3] - 1.0).abs() < 1e-15);
        assert!((h.estimate(&[1.0, 0.0]) - 0.25).abs() < 1e-15);
        assert!((h.width_sq(&[1.0, 0.0]) - 0.5).abs() < 1e-15);
        assert!((h.width_sq(&[0.0, 1.0]) - 1.0).abs() < 1e-15);
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
        assert!((h.a_inv()[0] - 1.0).abs() < 1e-12 && (h.a_inv()[3] - 0.5).abs() < 1e-12);
        assert!(h.estimate(&[1.0, 0.0]).abs() < 1e-12);
        assert!((h.estimate(&[0.0, 1.0]) - 0.5).abs() < 1e-12);
    }
}
