//! Query features: a deterministic featurizer that turns query text into a fixed-dimension,
//! L2-normalised vector, and the checks on a caller-supplied vector.
//!
//! Layout of a vector of dimension `d`:
//! - `x[0]`: bias;
//! - `x[1..=4]`: one-hot length bucket (≤ 4 words, ≤ 16, ≤ 64, longer);
//! - `x[5..d]`: signed feature hashing of lowercased words, word bigrams and character
//!   trigrams of each word (with boundary marks), so that related wordings land near each other.
//!
//! The hashed block is normalised to unit length before the bias and bucket are added, so a
//! long query does not drown the bias; then the whole vector is normalised to unit length.

use crate::error::ConfigError;

/// Dimensions taken by the bias and the length bucket.
const HEADER: usize = 5;

/// FNV-1a, 64 bit: stable across platforms and releases, unlike `std`'s hasher.
#[derive(Clone, Copy, Debug)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Fnv64::new()
    }
}

impl Fnv64 {
    #[must_use]
    pub fn new() -> Fnv64 {
        Fnv64(0xcbf2_9ce4_8422_2325)
    }
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    #[must_use]
    pub fn finish(&self) -> u64 {
        // A final avalanche so that low bits (used for the bucket index) mix all input bits.
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Turns query text into feature vectors of a fixed dimension.
#[derive(Clone, Debug)]
pub struct Featurizer {
    dim: usize,
}

impl Featurizer {
    /// Smallest useful dimension: the header plus a few hashed buckets.
    pub const MIN_DIM: usize = 8;
    /// The default dimension.
    pub const DEFAULT_DIM: usize = 64;

    /// A featurizer producing `dim`-dimensional vectors.
    ///
    /// # Errors
    /// `dim` below [`Featurizer::MIN_DIM`] or above 4096.
    pub fn new(dim: usize) -> Result<Featurizer, ConfigError> {
        if !(Self::MIN_DIM..=4096).contains(&dim) {
            return Err(crate::error::out_of_range(
                "feature_dim",
                dim,
                "must be between 8 and 4096 (default 64)",
            ));
        }
        Ok(Featurizer { dim })
    }

    /// The vector dimension.
    #[must_use]
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Features of `text`: deterministic, unit length, `dim` entries.
    #[must_use]
    pub fn featurize(&self, text: &str) -> Vec<f64> {
        let mut x = vec![0.0; self.dim];
        self.featurize_into(text, &mut x);
        x
    }

    /// Like [`Featurizer::featurize`], writing into `out` (which must have `dim` entries).
    pub fn featurize_into(&self, text: &str, out: &mut [f64]) {
        out.fill(0.0);
        let hashed_dims = self.dim - HEADER;
        let lower = text.to_lowercase();
        let words: Vec<&str> = lower
            .split(|c: char| !c.is_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect();
        let mut add = |parts: &[&[u8]]| {
            let mut h = Fnv64::new();
            for p in parts {
                h.write(p);
                h.write(&[0x1f]);
            }
            let v = h.finish();
            let bucket = (v % hashed_dims as u64) as usize;
            let sign = if v >> 63 == 0 { 1.0 } else { -1.0 };
            out[HEADER + bucket] += sign;
        };
        for (i, w) in words.iter().enumerate() {
            add(&[b"w", w.as_bytes()]);
            if let Some(next) = words.get(i + 1) {
                add(&[b"b", w.as_bytes(), next.as_bytes()]);
            }
            let marked: Vec<char> = std::iter::once('^')
                .chain(w.chars())
                .chain(std::iter::once('$'))
                .collect();
            let mut buf = [0u8; 12];
            for tri in marked.windows(3) {
                let mut len = 0;
                for c in tri {
                    len += c.encode_utf8(&mut buf[len..]).len();
                }
                add(&[b"c", &buf[..len]]);
            }
        }
        normalise(&mut out[HEADER..]);
        out[0] = 1.0;
        let bucket = match words.len() {
            0..=4 => 1,
            5..=16 => 2,
            17..=64 => 3,
            _ => 4,
        };
        out[bucket] = 1.0;
        normalise(out);
    }
}

/// Scales `x` to unit L2 norm (a zero vector stays zero).
pub fn normalise(x: &mut [f64]) {
    let norm = x.iter().map(|v| v * v).sum::<f64>().sqrt();
    if norm > 0.0 {
        for v in x {
            *v /= norm;
        }
    }
}

/// Checks a caller-supplied feature vector: dimension and finiteness.
///
/// # Errors
/// A wrong dimension or a non-finite element, with the fix in the message.
pub fn check_features(x: &[f64], expected_dim: usize) -> Result<(), ConfigError> {
    if x.len() != expected_dim {
        return Err(ConfigError::FeatureDimension {
            expected: expected_dim,
            got: x.len(),
        });
    }
    if let Some(index) = x.iter().position(|v| !v.is_finite()) {
        return Err(ConfigError::FeatureNotFinite { index });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(x: &[f64]) -> f64 {
        x.iter().map(|v| v * v).sum::<f64>().sqrt()
    }

    fn cosine(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>() / (norm(a) * norm(b))
    }

    #[test]
    fn vectors_are_unit_length_and_deterministic() {
        let f = Featurizer::new(64).unwrap();
        for q in [
            "",
            "a",
            "Who wrote the Iliad?",
            &"long ".repeat(200),
            "日本語のクエリ",
        ] {
            let x = f.featurize(q);
            assert_eq!(x.len(), 64);
            assert!((norm(&x) - 1.0).abs() < 1e-12, "{q}: norm {}", norm(&x));
            assert_eq!(x, f.featurize(q));
        }
    }

    #[test]
    fn related_queries_are_closer_than_unrelated_ones() {
        let f = Featurizer::new(64).unwrap();
        let a = f.featurize("latest rust compiler release notes");
        let b = f.featurize("rust compiler release notes 1.95");
        let c = f.featurize("chocolate cake recipe without eggs");
        assert!(cosine(&a, &b) > cosine(&a, &c) + 0.2);
    }

    #[test]
    fn length_bucket_is_one_hot() {
        let f = Featurizer::new(16).unwrap();
        let short = f.featurize("two words");
        let long = f.featurize(&"w ".repeat(30));
        assert!(short[1] > 0.0 && short[3] == 0.0);
        assert!(long[3] > 0.0 && long[1] == 0.0);
    }

    #[test]
    fn bad_dimensions_and_vectors_are_rejected_with_the_fix() {
        let err = Featurizer::new(4).unwrap_err().to_string();
        assert!(
            err.contains("feature_dim") && err.contains("between 8 and 4096"),
            "{err}"
        );
        let err = check_features(&[0.0; 3], 8).unwrap_err().to_string();
        assert!(
            err.contains("3 dimensions") && err.contains("expects 8"),
            "{err}"
        );
        let err = check_features(&[0.0, f64::NAN], 2).unwrap_err().to_string();
        assert!(err.contains("element 1"), "{err}");
    }
}
