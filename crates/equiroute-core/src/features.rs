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
//!
//! Only the first `max_words` words are hashed (default 128; a query longer than that is in
//! the "longer" bucket): the cost of a decision stays bounded whatever the prompt's size,
//! and 59 hashed buckets are saturated long before the hundredth word anyway.

use crate::error::ConfigError;

/// Dimensions taken by the bias and the length bucket.
const HEADER: usize = 5;

/// The separator written after each part of a hashed feature.
const SEP: u8 = 0x1f;

/// `v % n` for a fixed `n`, without a division per feature: Lemire, Kaser and Kurz's
/// "faster remainder by direct computation" (2019), exact for every 64-bit `v`.
#[derive(Clone, Copy, Debug)]
struct Buckets {
    n: u64,
    /// `⌊(2¹²⁸ − 1) / n⌋ + 1`.
    magic: u128,
}

impl Buckets {
    /// `n` ≥ 2 (the featurizer's hashed block has at least `MIN_DIM − HEADER` = 3 entries).
    fn new(n: usize) -> Buckets {
        debug_assert!(n >= 2);
        let n = n as u64;
        Buckets {
            n,
            magic: u128::MAX / u128::from(n) + 1,
        }
    }

    /// `v % n`: the high 64 bits of the fraction `magic · v mod 2¹²⁸` times `n`.
    fn of(self, v: u64) -> usize {
        let low = self.magic.wrapping_mul(u128::from(v));
        let n = u128::from(self.n);
        let top = (low >> 64) * n + (((low & u128::from(u64::MAX)) * n) >> 64);
        // `top >> 64` is below n ≤ 4096.
        #[allow(clippy::cast_possible_truncation)]
        let r = (top >> 64) as usize;
        r
    }
}

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
    /// Words hashed at most; the rest of a longer text is not read.
    max_words: usize,
}

/// One of two iterators over the same items.
enum Either<A, B> {
    Left(A),
    Right(B),
}

impl<T, A: Iterator<Item = T>, B: Iterator<Item = T>> Iterator for Either<A, B> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        match self {
            Either::Left(a) => a.next(),
            Either::Right(b) => b.next(),
        }
    }
}

/// The words of a text, as the featurizer splits them: maximal runs of alphanumeric
/// characters. An ASCII text (`ascii`: the caller's `text.is_ascii()`) is split on its bytes,
/// where a character is its byte (the same words, without decoding characters).
fn split_words(text: &str, ascii: bool) -> impl Iterator<Item = &str> {
    if ascii {
        let base = text.as_ptr() as usize;
        Either::Left(
            text.as_bytes()
                .split(|b| !b.is_ascii_alphanumeric())
                .filter(|w| !w.is_empty())
                // The word is a slice of `text`: its place is an offset into it.
                .map(move |w| {
                    let at = w.as_ptr() as usize - base;
                    &text[at..at + w.len()]
                }),
        )
    } else {
        Either::Right(
            text.split(|c: char| !c.is_alphanumeric())
                .filter(|w| !w.is_empty()),
        )
    }
}

/// Where `word`, a slice of `text`, ends in it.
fn end_in(text: &str, word: &str) -> usize {
    word.as_ptr() as usize - text.as_ptr() as usize + word.len()
}

/// The text through the end of its `n`-th word (words as the featurizer splits them, before
/// lowercasing), or the whole text when it is short or has fewer words.
fn through_word(text: &str, n: usize) -> &str {
    // Up to 16 bytes a word the whole text is taken: the word loop stops at the cap anyway,
    // and lowercasing a few hundred bytes more costs less than finding where to cut.
    let mut k = 16 * n;
    if text.len() <= k {
        return text;
    }
    // Look for the n-th word in the first 16·n bytes only (not the whole text, which may be
    // megabytes); it counts if it ends before them, where nothing can continue it.
    while !text.is_char_boundary(k) {
        k += 1;
    }
    let head = &text[..k];
    if let Some(w) = split_words(head, head.is_ascii()).nth(n.saturating_sub(1)) {
        let end = end_in(head, w);
        if end < k {
            return &text[..end];
        }
    }
    // Long words: the whole text.
    split_words(text, text.is_ascii())
        .nth(n.saturating_sub(1))
        .map_or(text, |w| &text[..end_in(text, w)])
}

impl Featurizer {
    /// Smallest useful dimension: the header plus a few hashed buckets.
    pub const MIN_DIM: usize = 8;
    /// The default dimension.
    pub const DEFAULT_DIM: usize = 64;
    /// The default number of words hashed.
    pub const DEFAULT_MAX_WORDS: usize = 128;
    /// The fewest words a featurizer may be limited to: the length bucket must see past 64.
    pub const MIN_MAX_WORDS: usize = 64;

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
        Ok(Featurizer {
            dim,
            max_words: Self::DEFAULT_MAX_WORDS,
        })
    }

    /// The same featurizer hashing at most `max_words` words of a text.
    ///
    /// # Errors
    /// `max_words` out of range (see [`Featurizer::check_max_words`]).
    pub fn with_max_words(self, max_words: usize) -> Result<Featurizer, ConfigError> {
        Self::check_max_words(max_words)?;
        Ok(Featurizer { max_words, ..self })
    }

    /// Checks a `feature_max_words` setting.
    ///
    /// # Errors
    /// Below [`Featurizer::MIN_MAX_WORDS`] or above 1,000,000, with the fix.
    pub fn check_max_words(max_words: usize) -> Result<(), ConfigError> {
        if (Self::MIN_MAX_WORDS..=1_000_000).contains(&max_words) {
            return Ok(());
        }
        Err(crate::error::out_of_range(
            "feature_max_words",
            max_words,
            "must be between 64 and 1000000 (default 128): the length feature tells \
             texts of more than 64 words apart",
        ))
    }

    /// The vector dimension.
    #[must_use]
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The most words of a text that are hashed.
    #[must_use]
    pub fn max_words(&self) -> usize {
        self.max_words
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
        let buckets = Buckets::new(self.dim - HEADER);
        // Lowercase no more than the words that will be read, and one more, so that a final
        // sigma at the end of the last word read is judged by what follows it.
        let lower = through_word(text, self.max_words + 1).to_lowercase();
        // Every feature is FNV-1a over its parts, each followed by 0x1f: ("w", word),
        // ("b", word, next word), ("c", trigram of the word marked ^word$). The states after
        // the fixed prefixes are computed once, a bigram starts from the state its first
        // word left, and nothing is allocated per word. Counts are small integers, so the
        // order features are added in does not change a bit of the result.
        let prefix = |kind: &[u8]| {
            let mut h = Fnv64::new();
            h.write(kind);
            h.write(&[SEP]);
            h
        };
        let (word_prefix, bigram_prefix, trigram_prefix) =
            (prefix(b"w"), prefix(b"b"), prefix(b"c"));
        let mut add = |h: Fnv64| {
            let v = h.finish();
            let sign = if v >> 63 == 0 { 1.0 } else { -1.0 };
            out[HEADER + buckets.of(v)] += sign;
        };
        let mut words = 0usize;
        let mut capped = false;
        // The bigram of the previous word, waiting for this one.
        let mut open_bigram: Option<Fnv64> = None;
        // Whether every word is ASCII, asked once for the text rather than per word.
        let ascii = lower.is_ascii();
        for w in split_words(&lower, ascii) {
            if words == self.max_words {
                capped = true;
                break;
            }
            words += 1;
            // The word, the bigram it closes and the bigram it opens read its bytes in one
            // pass: three independent FNV states (the first word closes none).
            let [mut h, mut closing, mut b] = [
                word_prefix,
                open_bigram.unwrap_or(word_prefix),
                bigram_prefix,
            ];
            for &byte in w.as_bytes().iter().chain(&[SEP]) {
                for state in [&mut h, &mut closing, &mut b] {
                    state.write(&[byte]);
                }
            }
            add(h);
            if open_bigram.is_some() {
                add(closing);
            }
            open_bigram = Some(b);
            // Trigrams of ^word$, sliding over the characters (over the bytes when the word
            // is ASCII, where each character is its byte).
            if ascii || w.is_ascii() {
                let b = w.as_bytes();
                let marked = |k: usize| match k {
                    0 => b'^',
                    k if k > b.len() => b'$',
                    k => b[k - 1],
                };
                for k in 0..b.len() {
                    let mut h = trigram_prefix;
                    h.write(&[marked(k), marked(k + 1), marked(k + 2), SEP]);
                    add(h);
                }
            } else {
                let (mut first, mut second) = ('^', None);
                for c in w.chars().chain(std::iter::once('$')) {
                    if let Some(mid) = second {
                        let mut h = trigram_prefix;
                        let mut buf = [0u8; 4];
                        for ch in [first, mid, c] {
                            h.write(ch.encode_utf8(&mut buf).as_bytes());
                        }
                        h.write(&[SEP]);
                        add(h);
                        first = mid;
                    }
                    second = Some(c);
                }
            }
        }
        normalise(&mut out[HEADER..]);
        out[0] = 1.0;
        // More than max_words (at least 64) words: the "longer" bucket.
        let bucket = match words + usize::from(capped) {
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
    fn only_the_first_max_words_words_are_read() {
        let f = Featurizer::new(64).unwrap();
        let everything = Featurizer::new(64)
            .unwrap()
            .with_max_words(1_000_000)
            .unwrap();
        let words: Vec<String> = (0..400).map(|i| format!("w{i}")).collect();
        let first = words[..128].join(" ");
        let all = words.join(" ");
        // Past the cap nothing is read: the vector of the first 128 words alone.
        assert_eq!(f.featurize(&all), f.featurize(&first));
        // Up to the cap, the vector of a featurizer that reads everything.
        assert_eq!(f.featurize(&first), everything.featurize(&first));
        assert_ne!(f.featurize(&all), everything.featurize(&all));
        // A higher cap reads further; at the lowest cap a long text is still "longer".
        let f200 = Featurizer::new(64).unwrap().with_max_words(200).unwrap();
        assert_ne!(f200.featurize(&all), f200.featurize(&first));
        let x = Featurizer::new(64)
            .unwrap()
            .with_max_words(64)
            .unwrap()
            .featurize(&all);
        assert!(x[4] > 0.0 && x[3] == 0.0, "{x:?}");
        // Words are counted after lowercasing: "İ" lowercases to "i" and a combining dot,
        // which splits "İİİ" into three words; the 128th word is the first of them.
        let before = words[..127].join(" ");
        assert_eq!(
            f.featurize(&format!("{before} İİİ {}", words[200..].join(" "))),
            everything.featurize(&format!("{before} İ"))
        );
        // Words longer than 16 bytes: the 129th word lies past the first 16·129 bytes.
        let long: Vec<String> = (0..300).map(|i| format!("{i:0>20}x")).collect();
        assert_eq!(
            f.featurize(&long.join(" ")),
            f.featurize(&long[..128].join(" "))
        );
        let err = Featurizer::new(64)
            .unwrap()
            .with_max_words(10)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("feature_max_words") && err.contains("between 64 and 1000000"),
            "{err}"
        );
    }

    #[test]
    fn ascii_texts_split_into_the_words_unicode_splitting_gives() {
        let unicode = |t: &str| -> Vec<String> {
            t.split(|c: char| !c.is_alphanumeric())
                .filter(|w| !w.is_empty())
                .map(str::to_owned)
                .collect()
        };
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for len in 0..300 {
            // Bytes drawn from letters, digits, punctuation, controls and separators.
            let text: String = (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    char::from((state >> 57) as u8)
                })
                .collect();
            assert!(text.is_ascii());
            let ours: Vec<String> = split_words(&text, true).map(str::to_owned).collect();
            assert_eq!(ours, unicode(&text), "{text:?}");
        }
        let mixed = "naïve café, ΟΔΟΣ — x86_64 日本語 ok";
        let ours: Vec<String> = split_words(mixed, mixed.is_ascii())
            .map(str::to_owned)
            .collect();
        assert_eq!(ours, unicode(mixed));
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

    /// Texts whose features were recorded before the featurizer was made faster: learnt
    /// state (LinUCB heads over these dimensions) survives an upgrade only if every text
    /// still maps to the very same vector.
    const GOLDEN_TEXTS: [&str; 7] = [
        "",
        "hello",
        "Who wrote the Iliad? And who translated it, in 1598?",
        "ΟΔΟΣ Σίσυφος ΣΣ straße İstanbul ǅemal",
        "日本語のクエリ、そして english words",
        "tabs\tand\nnewlines -- and---dashes, x86_64 v1.95.0",
        "a b c d e f g h i j k l m n o p q r s t u v w x y z a b c d e f g h i j k l m n o p q r s t u v w x y z a b c d e f g h i j k l m n o p q r s t u v w x y z",
    ];

    fn fingerprint(x: &[f64]) -> u64 {
        let mut h = Fnv64::new();
        for v in x {
            h.write(&v.to_bits().to_le_bytes());
        }
        h.finish()
    }

    #[test]
    fn features_are_bit_for_bit_those_recorded_before_the_speed_up() {
        let golden: [(usize, [u64; 7]); 3] = [
            (
                8,
                [
                    0x4083_8b22_b3b0_3795,
                    0x24fd_65c3_5368_100c,
                    0x7405_0002_f612_0221,
                    0xdae5_f07a_9efe_7d44,
                    0xd321_501c_18db_c603,
                    0x57bc_1436_8e99_d2af,
                    0x0b9b_1838_df3d_7215,
                ],
            ),
            (
                64,
                [
                    0xe9e2_6d21_58cc_44fc,
                    0x5a59_af34_0fc3_cf78,
                    0x506d_0230_b558_c0b5,
                    0xc3d2_e34b_a079_4c57,
                    0x5ee3_1b00_aba7_6184,
                    0x8f19_5252_db38_0551,
                    0xb554_993a_b11b_5ce9,
                ],
            ),
            (
                100,
                [
                    0xf861_9628_14c6_2a15,
                    0x3a51_6fc5_9826_a274,
                    0x18ff_95d1_9d05_9f90,
                    0xf649_3ace_93f0_ac5a,
                    0x0de0_b3b1_0247_e338,
                    0xafd2_550f_26c8_477f,
                    0x03f1_a7ed_591b_aa0f,
                ],
            ),
        ];
        for (d, prints) in golden {
            let f = Featurizer::new(d).unwrap();
            for (text, want) in GOLDEN_TEXTS.iter().zip(prints) {
                assert_eq!(fingerprint(&f.featurize(text)), want, "d = {d}, {text:?}");
            }
        }
    }

    #[test]
    fn the_remainder_without_division_is_exact() {
        let mut v = 0x9e37_79b9_7f4a_7c15_u64;
        for n in [3usize, 59, 64, 95, 4091] {
            let b = Buckets::new(n);
            for edge in [
                0,
                1,
                u64::MAX,
                u64::MAX - 1,
                n as u64,
                n as u64 - 1,
                (n as u64) << 40,
            ] {
                assert_eq!(b.of(edge), (edge % n as u64) as usize, "{edge} % {n}");
            }
            for _ in 0..100_000 {
                v ^= v << 13;
                v ^= v >> 7;
                v ^= v << 17;
                assert_eq!(b.of(v), (v % n as u64) as usize, "{v} % {n}");
            }
        }
    }
}
