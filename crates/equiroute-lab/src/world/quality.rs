//! Quality models: what a provider's answer is worth, by metric.
//!
//! - accuracy: Bernoulli with the cluster mean `q` as probability;
//! - F1: Beta with mean `q` and concentration 6 (answers vary around the provider's level);
//! - nDCG@10: the query has 20 judged documents with graded relevance 0–3; the provider ranks
//!   them by relevance plus noise whose spread shrinks as its skill `q` grows, and the top 10
//!   are scored as trec_eval's `ndcg_cut_10` does (gain = relevance, discount log2(rank + 1),
//!   ideal = the judged documents sorted by relevance).

use crate::scenario::Metric;
use rand::{Rng, RngCore};
use rand_distr::{Beta, Distribution, StandardNormal};

const F1_CONCENTRATION: f64 = 6.0;
const DOCS: usize = 20;
const CUTOFF: usize = 10;

/// One gold quality draw for mean (or skill) `q`.
pub fn draw(metric: Metric, q: f64, rng: &mut dyn RngCore) -> f64 {
    match metric {
        Metric::Accuracy => f64::from(u8::from(rng.random::<f64>() < q)),
        Metric::F1 => {
            let a = (q * F1_CONCENTRATION).max(1e-3);
            let b = ((1.0 - q) * F1_CONCENTRATION).max(1e-3);
            Beta::new(a, b).map_or(q, |d| d.sample(rng))
        }
        Metric::Ndcg => {
            let mut rels = [0u8; DOCS];
            rels[0] = 3;
            for r in rels.iter_mut().skip(1) {
                let u: f64 = rng.random();
                *r = if u < 0.55 {
                    0
                } else if u < 0.80 {
                    1
                } else if u < 0.92 {
                    2
                } else {
                    3
                };
            }
            let noise = 0.25 + 4.0 * (1.0 - q).powi(2);
            let mut scored: Vec<(f64, u8)> = rels
                .iter()
                .map(|&r| {
                    let z: f64 = StandardNormal.sample(rng);
                    (f64::from(r) + noise * z, r)
                })
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0));
            let ranked: Vec<u8> = scored.iter().map(|s| s.1).collect();
            ndcg_at(&ranked, &rels, CUTOFF)
        }
    }
}

/// nDCG@k as trec_eval computes it: `Σ rel_i / log2(i + 1)` over the first k ranks, divided
/// by the same sum for the judged documents in ideal order.
#[must_use]
pub fn ndcg_at(ranked: &[u8], judged: &[u8], k: usize) -> f64 {
    let dcg = |rels: &[u8]| -> f64 {
        rels.iter()
            .take(k)
            .enumerate()
            .map(|(i, &r)| f64::from(r) / ((i + 2) as f64).log2())
            .sum()
    };
    let mut ideal = judged.to_vec();
    ideal.sort_unstable_by(|a, b| b.cmp(a));
    let idcg = dcg(&ideal);
    if idcg > 0.0 {
        dcg(ranked) / idcg
    } else {
        0.0
    }
}

/// The expected gold quality for mean (or skill) `q`: exact where closed-form, Monte Carlo
/// over 2000 draws for nDCG.
pub fn expected(metric: Metric, q: f64, rng: &mut dyn RngCore) -> f64 {
    match metric {
        Metric::Accuracy | Metric::F1 => q,
        Metric::Ndcg => (0..2000).map(|_| draw(metric, q, rng)).sum::<f64>() / 2000.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn ndcg_matches_a_hand_computed_ranking() {
        // Ranked rels [3, 0, 2], judged {3, 2, 0}: DCG = 3/1 + 0/log2 3 + 2/2 = 4;
        // IDCG = 3/1 + 2/log2 3 + 0 = 4.2619; nDCG = 0.93855.
        let n = ndcg_at(&[3, 0, 2], &[3, 2, 0], 10);
        assert!((n - 4.0 / (3.0 + 2.0 / 3f64.log2())).abs() < 1e-12);
        assert!((ndcg_at(&[3, 2, 0], &[0, 2, 3], 10) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn better_skill_gives_better_expected_quality() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let low = expected(Metric::Ndcg, 0.3, &mut rng);
        let high = expected(Metric::Ndcg, 0.9, &mut rng);
        assert!(
            high > low + 0.15 && high <= 1.0 && low > 0.0,
            "{low} {high}"
        );
        let f1: f64 = (0..20_000)
            .map(|_| draw(Metric::F1, 0.6, &mut rng))
            .sum::<f64>()
            / 20_000.0;
        assert!((f1 - 0.6).abs() < 0.01);
    }
}
