//! Dense kernels for small symmetric matrices, stored row-major or as packed upper
//! triangles. The hot kernels use explicit SIMD types from `wide`.

use wide::{f32x8, f64x4};

/// `a · b`, with four independent vector accumulators (explicit SIMD through `wide`, so the
/// kernel does not depend on the auto-vectoriser).
#[must_use]
#[inline]
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len());
    let (ca, _) = a[..n].as_chunks::<16>();
    let (cb, _) = b[..n].as_chunks::<16>();
    let mut acc = [f64x4::ZERO; 4];
    for (x, y) in ca.iter().zip(cb) {
        for k in 0..4 {
            let xv = f64x4::from([x[4 * k], x[4 * k + 1], x[4 * k + 2], x[4 * k + 3]]);
            let yv = f64x4::from([y[4 * k], y[4 * k + 1], y[4 * k + 2], y[4 * k + 3]]);
            acc[k] = xv.mul_add(yv, acc[k]);
        }
    }
    let full = ca.len() * 16;
    let tail: f64 = a[full..n].iter().zip(&b[full..n]).map(|(x, y)| x * y).sum();
    ((acc[0] + acc[1]) + (acc[2] + acc[3])).reduce_add() + tail
}

/// Defines a four-matrix dot kernel for one element type and its SIMD vector.
macro_rules! four_dots {
    ($(#[$doc:meta])* $name:ident, $t:ty, $v:ty, $lanes:literal) => {
        $(#[$doc])*
        #[must_use]
        #[inline]
        pub fn $name(ms: [&[$t]; 4], z: &[$t]) -> [$t; 4] {
            let n = ms.iter().fold(z.len(), |n, m| n.min(m.len()));
            let (zc, _) = z[..n].as_chunks::<$lanes>();
            let [(c0, _), (c1, _), (c2, _), (c3, _)] = ms.map(|m| m[..n].as_chunks::<$lanes>());
            let mut acc = [<$v>::ZERO; 4];
            for ((((zv, v0), v1), v2), v3) in zc.iter().zip(c0).zip(c1).zip(c2).zip(c3) {
                let zv = <$v>::from(*zv);
                acc[0] = <$v>::from(*v0).mul_add(zv, acc[0]);
                acc[1] = <$v>::from(*v1).mul_add(zv, acc[1]);
                acc[2] = <$v>::from(*v2).mul_add(zv, acc[2]);
                acc[3] = <$v>::from(*v3).mul_add(zv, acc[3]);
            }
            let full = zc.len() * $lanes;
            let tail = |m: &[$t]| m[full..n].iter().zip(&z[full..n]).map(|(a, b)| a * b).sum::<$t>();
            [
                acc[0].reduce_add() + tail(ms[0]),
                acc[1].reduce_add() + tail(ms[1]),
                acc[2].reduce_add() + tail(ms[2]),
                acc[3].reduce_add() + tail(ms[3]),
            ]
        }
    };
}

four_dots!(
    /// `dot(m_h, z)` for four matrices at once: `z` is loaded once for all of them, which is
    /// what bounds a single dot (two loads per multiply-add).
    dots, f64, f64x4, 4
);

four_dots!(
    /// Single-precision counterpart of [`dots`], for the exploration widths (see
    /// [`super::linucb::LinUcbConfig::fast_width`]).
    dots_f32, f32, f32x8, 8
);

/// Single-precision `a · b`.
#[must_use]
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (ca, _) = a[..n].as_chunks::<8>();
    let (cb, _) = b[..n].as_chunks::<8>();
    let mut acc = f32x8::ZERO;
    for (x, y) in ca.iter().zip(cb) {
        acc = f32x8::from(*x).mul_add(f32x8::from(*y), acc);
    }
    let full = ca.len() * 8;
    acc.reduce_add()
        + a[full..n]
            .iter()
            .zip(&b[full..n])
            .map(|(x, y)| x * y)
            .sum::<f32>()
}

/// `out = M x` for a `d × d` row-major `m`.
#[inline]
pub fn mat_vec(m: &[f64], x: &[f64], out: &mut [f64]) {
    let d = x.len();
    for (row, o) in m.chunks_exact(d).zip(out.iter_mut()) {
        *o = dot(row, x);
    }
}

/// `M += s · v vᵀ` (symmetric rank-one update).
#[inline]
pub fn rank_one_update(m: &mut [f64], v: &[f64], s: f64) {
    let d = v.len();
    for (row, &vi) in m.chunks_exact_mut(d).zip(v) {
        let f = s * vi;
        for (mij, &vj) in row.iter_mut().zip(v) {
            *mij += f * vj;
        }
    }
}

/// Length of the packed upper triangle of a `d × d` symmetric matrix.
#[must_use]
pub const fn packed_len(d: usize) -> usize {
    d * (d + 1) / 2
}

/// Iterates the rows of a packed upper triangle: row `i` is `M[i][i..d]`.
#[inline]
fn packed_rows(p: &[f64], d: usize) -> impl Iterator<Item = (usize, &[f64])> {
    let mut start = 0;
    (0..d).map(move |i| {
        let len = d - i;
        let row = &p[start..start + len];
        start += len;
        (i, row)
    })
}

/// `xᵀ M x` for a symmetric `M` stored as a packed upper triangle: half the work of a full
/// product.
#[must_use]
#[inline]
pub fn packed_quad_form(p: &[f64], x: &[f64]) -> f64 {
    let d = x.len();
    let mut s = 0.0;
    for (i, row) in packed_rows(p, d) {
        let off_diagonal = dot(&row[1..], &x[i + 1..]);
        s += x[i] * (row[0] * x[i] + 2.0 * off_diagonal);
    }
    s
}

/// The nonzero entries of `x` as `(index, value)` in index order, or `None` when there are
/// more than `max`: a short query's features are mostly zeros (bias, length bucket and the
/// few hashed buckets its words reach: 8 of 64 for one word).
#[must_use]
pub fn nonzeros(x: &[f64], max: usize) -> Option<Vec<(usize, f64)>> {
    // One pass, given up at the first nonzero beyond `max` (a dense query, the ranking's
    // other path, stops early and drops the small buffer).
    let mut nz = Vec::with_capacity(max);
    for (i, &v) in x.iter().enumerate() {
        if v != 0.0 {
            if nz.len() == max {
                return None;
            }
            nz.push((i, v));
        }
    }
    Some(nz)
}

/// `xᵀ M x` for a packed symmetric `M` of dimension `d`, from the [`nonzeros`] of `x`:
/// `n(n+1)/2` terms for `n` nonzeros instead of `d(d+1)/2`, in double precision. Entries
/// beyond `M` (an `x` longer than `d`) count as zero.
#[must_use]
pub fn packed_quad_form_sparse(p: &[f64], d: usize, nz: &[(usize, f64)]) -> f64 {
    // Every column below is inside its row.
    let nz = within(nz, d);
    let whole = packed_len(d);
    let mut s = 0.0;
    for (k, &(i, xi)) in nz.iter().enumerate() {
        // Row i, M[i][i..d], starts after rows 0..i: the whole triangle less rows i..d.
        let start = whole - packed_len(d - i);
        let Some(row) = p.get(start..start + (d - i)) else {
            break;
        };
        let mut off_diagonal = 0.0;
        for &(j, xj) in &nz[k + 1..] {
            // i < j < d: column j - i of the row.
            off_diagonal += row[j - i] * xj;
        }
        s += xi * (row[0] * xi + 2.0 * off_diagonal);
    }
    s
}

/// [`packed_quad_form_sparse`] for `M = m·I`, in `n` terms: the same floating-point
/// operations as the general form, whose off-diagonal sums are then `+0.0` (`x·(m·x + 2·0)`
/// is `x·(m·x)`), so the two agree to the bit.
#[must_use]
pub fn scaled_identity_quad_form_sparse(m: f64, d: usize, nz: &[(usize, f64)]) -> f64 {
    within(nz, d)
        .iter()
        .fold(0.0, |s, &(_, xi)| s + xi * (m * xi))
}

/// The [`nonzeros`] of `x` inside a matrix of dimension `d`: `nz` is in index order, so the
/// entries beyond it are its tail.
fn within(nz: &[(usize, f64)], d: usize) -> &[(usize, f64)] {
    &nz[..nz.partition_point(|&(i, _)| i < d)]
}

/// `a · x` from the [`nonzeros`] of `x`.
#[must_use]
pub fn dot_sparse(a: &[f64], nz: &[(usize, f64)]) -> f64 {
    nz.iter()
        .map(|&(i, v)| a.get(i).map_or(0.0, |ai| ai * v))
        .sum()
}

/// The packed outer product of `x` with off-diagonal entries doubled, so that for any packed
/// symmetric `M`, `xᵀ M x = dot(M, packed_outer(x))`: one contiguous dot per matrix instead
/// of `d` short ones, computed once per request and shared by every candidate.
#[must_use]
pub fn packed_outer(x: &[f64]) -> Vec<f64> {
    let d = x.len();
    let mut z = vec![0.0; packed_len(d)];
    let mut start = 0;
    for i in 0..d {
        let xi = x[i];
        let twice = 2.0 * xi;
        let row = &mut z[start..start + d - i];
        row[0] = xi * xi;
        for (zj, xj) in row[1..].iter_mut().zip(&x[i + 1..]) {
            *zj = twice * xj;
        }
        start += d - i;
    }
    z
}

/// `out1 = M x1` and `out2 = M x2` in one pass over a packed symmetric `M`.
#[inline]
pub fn packed_mat_vec2(p: &[f64], x1: &[f64], x2: &[f64], out1: &mut [f64], out2: &mut [f64]) {
    let d = x1.len();
    out1.fill(0.0);
    out2.fill(0.0);
    for (i, row) in packed_rows(p, d) {
        out1[i] += dot(row, &x1[i..]);
        out2[i] += dot(row, &x2[i..]);
        let (a, b) = (x1[i], x2[i]);
        for ((o1, o2), m) in out1[i + 1..]
            .iter_mut()
            .zip(&mut out2[i + 1..])
            .zip(&row[1..])
        {
            *o1 += m * a;
            *o2 += m * b;
        }
    }
}

/// `M += s·v vᵀ + t·w wᵀ` on a packed upper triangle, in one pass.
#[inline]
pub fn packed_rank_two(p: &mut [f64], v: &[f64], s: f64, w: &[f64], t: f64) {
    let d = v.len();
    let mut start = 0;
    for i in 0..d {
        let len = d - i;
        let (f, g) = (s * v[i], t * w[i]);
        for ((m, vj), wj) in p[start..start + len].iter_mut().zip(&v[i..]).zip(&w[i..]) {
            *m += f * vj + g * wj;
        }
        start += len;
    }
}

/// [`packed_outer`] in single precision, for the single-precision widths.
#[must_use]
pub fn packed_outer_f32(x: &[f64]) -> Vec<f32> {
    let d = x.len();
    let mut z = Vec::with_capacity(packed_len(d));
    for i in 0..d {
        let xi = x[i];
        z.push((xi * xi) as f32);
        let twice = 2.0 * xi;
        z.extend(x[i + 1..].iter().map(|xj| (twice * xj) as f32));
    }
    z
}

/// `out = M x` for a symmetric `M` stored as a packed upper triangle.
#[inline]
pub fn packed_mat_vec(p: &[f64], x: &[f64], out: &mut [f64]) {
    let d = x.len();
    out.fill(0.0);
    for (i, row) in packed_rows(p, d) {
        // Row i contributes M[i][j]·x[j] to out[i] and, by symmetry, M[i][j]·x[i] to out[j].
        out[i] += dot(row, &x[i..]);
        let xi = x[i];
        for (o, m) in out[i + 1..].iter_mut().zip(&row[1..]) {
            *o += m * xi;
        }
    }
}

/// `M += s · v vᵀ` on a packed upper triangle.
#[inline]
pub fn packed_rank_one(p: &mut [f64], v: &[f64], s: f64) {
    let d = v.len();
    let mut start = 0;
    for i in 0..d {
        let len = d - i;
        let f = s * v[i];
        for (m, vj) in p[start..start + len].iter_mut().zip(&v[i..]) {
            *m += f * vj;
        }
        start += len;
    }
}

/// Expands a packed upper triangle into a full row-major matrix.
#[must_use]
pub fn packed_to_full(p: &[f64], d: usize) -> Vec<f64> {
    let mut m = vec![0.0; d * d];
    for (i, row) in packed_rows(p, d) {
        for (k, &v) in row.iter().enumerate() {
            m[i * d + i + k] = v;
            m[(i + k) * d + i] = v;
        }
    }
    m
}

/// Packs the upper triangle of a full row-major symmetric matrix.
#[must_use]
pub fn full_to_packed(m: &[f64], d: usize) -> Vec<f64> {
    let mut p = Vec::with_capacity(packed_len(d));
    for i in 0..d {
        p.extend_from_slice(&m[i * d + i..(i + 1) * d]);
    }
    p
}

/// Inverse of a symmetric positive-definite `d × d` matrix by Cholesky factorisation.
/// Returns `None` when the matrix is not positive definite.
#[must_use]
pub fn spd_inverse(a: &[f64], d: usize) -> Option<Vec<f64>> {
    // Lower-triangular L with A = L Lᵀ.
    let mut l = vec![0.0; d * d];
    for i in 0..d {
        for j in 0..=i {
            let mut s = a[i * d + j];
            for k in 0..j {
                s -= l[i * d + k] * l[j * d + k];
            }
            if i == j {
                if s <= 0.0 || !s.is_finite() {
                    return None;
                }
                l[i * d + i] = s.sqrt();
            } else {
                l[i * d + j] = s / l[j * d + j];
            }
        }
    }
    // Invert L (lower triangular), then A⁻¹ = L⁻ᵀ L⁻¹.
    let mut li = vec![0.0; d * d];
    for i in 0..d {
        li[i * d + i] = 1.0 / l[i * d + i];
        for j in 0..i {
            let mut s = 0.0;
            for k in j..i {
                s -= l[i * d + k] * li[k * d + j];
            }
            li[i * d + j] = s / l[i * d + i];
        }
    }
    let mut inv = vec![0.0; d * d];
    for i in 0..d {
        for j in 0..=i {
            let mut s = 0.0;
            for k in i..d {
                s += li[k * d + i] * li[k * d + j];
            }
            inv[i * d + j] = s;
            inv[j * d + i] = s;
        }
    }
    Some(inv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spd_inverse_of_a_known_matrix() {
        // [[4,2],[2,3]]⁻¹ = 1/8 · [[3,-2],[-2,4]]
        let inv = spd_inverse(&[4.0, 2.0, 2.0, 3.0], 2).unwrap();
        let want = [0.375, -0.25, -0.25, 0.5];
        for (a, b) in inv.iter().zip(want) {
            assert!((a - b).abs() < 1e-15);
        }
        assert!(spd_inverse(&[1.0, 2.0, 2.0, 1.0], 2).is_none());
    }

    fn p2_seed(p: &[f64]) -> Vec<f64> {
        p.iter().map(|v| 2.0 * v).collect()
    }

    /// A symmetric positive definite `d × d` matrix, row-major: a Hilbert-like part plus 2·I.
    fn spd_matrix(d: usize) -> Vec<f64> {
        let mut full = vec![0.0; d * d];
        for i in 0..d {
            for j in 0..d {
                full[i * d + j] = 1.0 / (1.0 + (i + j) as f64) + if i == j { 2.0 } else { 0.0 };
            }
        }
        full
    }

    #[test]
    fn packed_kernels_match_full_ones() {
        let d = 5;
        let mut full = spd_matrix(d);
        let p = full_to_packed(&full, d);
        assert_eq!(p.len(), packed_len(d));
        assert_eq!(packed_to_full(&p, d), full);
        let x = [0.3, -1.0, 2.0, 0.5, -0.7];
        let mut want = vec![0.0; d];
        mat_vec(&full, &x, &mut want);
        let mut got = vec![0.0; d];
        packed_mat_vec(&p, &x, &mut got);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-12);
        }
        assert!((packed_quad_form(&p, &x) - dot(&x, &want)).abs() < 1e-12);
        assert!((dot(&p, &packed_outer(&x)) - dot(&x, &want)).abs() < 1e-12);
        let twice = p2_seed(&p);
        let [q0, q1, q2, q3] = dots([&p, &twice, &p, &twice], &packed_outer(&x));
        assert!((q0 - dot(&x, &want)).abs() < 1e-12 && (q2 - q0).abs() < 1e-15);
        assert!((q1 - 2.0 * dot(&x, &want)).abs() < 1e-12 && (q3 - q1).abs() < 1e-15);
        let x2 = [1.0, 0.5, -0.25, 0.0, 2.0];
        let (mut o1, mut o2) = (vec![0.0; d], vec![0.0; d]);
        packed_mat_vec2(&p, &x, &x2, &mut o1, &mut o2);
        let mut want2 = vec![0.0; d];
        mat_vec(&full, &x2, &mut want2);
        for i in 0..d {
            assert!((o1[i] - want[i]).abs() < 1e-12 && (o2[i] - want2[i]).abs() < 1e-12);
        }
        let mut r2 = p.clone();
        packed_rank_two(&mut r2, &x, 0.5, &x2, -0.25);
        let mut f2 = full.clone();
        rank_one_update(&mut f2, &x, 0.5);
        rank_one_update(&mut f2, &x2, -0.25);
        for (a, b) in packed_to_full(&r2, d).iter().zip(&f2) {
            assert!((a - b).abs() < 1e-12);
        }
        let mut p2 = p.clone();
        packed_rank_one(&mut p2, &x, 0.5);
        rank_one_update(&mut full, &x, 0.5);
        for (a, b) in packed_to_full(&p2, d).iter().zip(&full) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    /// The sparse kernels against the dense ones, on a 64 × 64 matrix and vectors with 1 to 64
    /// nonzeros (the first and last index included, where packed offsets go wrong first).
    #[test]
    fn sparse_kernels_match_dense_ones() {
        let d = 64;
        let full = spd_matrix(d);
        let p = full_to_packed(&full, d);
        for n in [1, 2, 5, 8, 24, 63, 64] {
            let mut x = vec![0.0; d];
            for k in 0..n {
                // Spread over 0..d, always including index 0 and, for n > 1, index d − 1.
                let i = if n == 1 { 0 } else { k * (d - 1) / (n - 1) };
                x[i] = 0.5 - (k as f64) * 0.03;
            }
            let nz = nonzeros(&x, d).unwrap();
            assert_eq!(nz.len(), n);
            let dense = packed_quad_form(&p, &x);
            let sparse = packed_quad_form_sparse(&p, d, &nz);
            assert!(
                (sparse - dense).abs() < 1e-12 * dense.abs().max(1.0),
                "{n}: {sparse} vs {dense}"
            );
            assert!((dot_sparse(&full[..d], &nz) - dot(&full[..d], &x)).abs() < 1e-12);
            assert!(nonzeros(&x, n - 1).is_none());
        }
        // A vector longer than the matrix: the entries beyond it count as zero, no panic.
        let nz = [(0, 1.0), (d + 3, 2.0)];
        assert!((packed_quad_form_sparse(&p, d, &nz) - p[0]).abs() < 1e-15);
        assert!(nonzeros(&[0.0; 4], 0).is_some_and(|nz| nz.is_empty()));
    }

    #[test]
    fn dot_handles_remainders() {
        let a: Vec<f64> = (1..=7).map(f64::from).collect();
        assert!((dot(&a, &a) - 140.0).abs() < 1e-12);
    }
}
