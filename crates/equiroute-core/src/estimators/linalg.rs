//! Dense kernels for small symmetric matrices stored row-major in a `Vec<f64>`.
//! Loops use several independent accumulators so the compiler can vectorise them.

/// `a · b`.
#[must_use]
#[inline]
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let chunks = a.len() / 4 * 4;
    for (ca, cb) in a[..chunks].chunks_exact(4).zip(b[..chunks].chunks_exact(4)) {
        acc[0] += ca[0] * cb[0];
        acc[1] += ca[1] * cb[1];
        acc[2] += ca[2] * cb[2];
        acc[3] += ca[3] * cb[3];
    }
    let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for i in chunks..a.len() {
        s += a[i] * b[i];
    }
    s
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

/// Makes `m` exactly symmetric by averaging it with its transpose.
pub fn symmetrize(m: &mut [f64], d: usize) {
    for i in 0..d {
        for j in (i + 1)..d {
            let avg = 0.5 * (m[i * d + j] + m[j * d + i]);
            m[i * d + j] = avg;
            m[j * d + i] = avg;
        }
    }
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

    #[test]
    fn dot_handles_remainders() {
        let a: Vec<f64> = (1..=7).map(f64::from).collect();
        assert!((dot(&a, &a) - 140.0).abs() < 1e-12);
    }
}
