//! An exploration floor around any policy: every eligible candidate keeps at least
//! `min_propensity` probability of going first, so that the log of the traffic supports the
//! off-policy evaluation of any other policy ([`crate::ope`]).
//!
//! After the wrapped policy ranks, one uniform draw `u` decides: with probability
//! `w = min(1, K·min_propensity)` (K eligible candidates) a uniformly chosen candidate is
//! moved first, else the policy's order stands. The first choice's probability is then
//!
//! ```text
//! P(first = c) = (1 − w)·p_policy(c) + w/K      (= (1 − K·floor)·p + floor when K·floor ≤ 1)
//! ```
//!
//! and is what [`Ranking::propensity`] reports. `p_policy(c)` is read from the
//! wrapped ranking when it says it (a deterministic policy's 1 or a Thompson policy's
//! estimate for its own first choice), else from its
//! [`Policy::first_choice_distribution`] with `propensity_samples` draws (only needed when
//! the floor picked another candidate than a Thompson policy's first, or the policy does not
//! estimate its propensity itself).

use super::{
    AttemptObservation, FirstChoice, Policy, PolicyKind, PolicyState, Propensity, PropensityKind,
    QualityObservation, RankContext, Ranking,
};
use crate::StateError;
use rand::{Rng, RngCore};
use serde::{Deserialize, Serialize};

/// The exploration floor's parameters (`min_propensity = 0` is no floor).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExplorationFloorConfig {
    /// Least probability of going first for every eligible candidate, in `[0, 0.5]`
    /// (e.g. 0.01). With K candidates, `K·min_propensity` of the traffic explores uniformly.
    pub min_propensity: f64,
    /// Draws that estimate a Thompson-sampled policy's probability of a candidate it did not
    /// put first (default 100).
    pub propensity_samples: u32,
}

impl Default for ExplorationFloorConfig {
    fn default() -> Self {
        ExplorationFloorConfig {
            min_propensity: 0.0,
            propensity_samples: 100,
        }
    }
}

impl ExplorationFloorConfig {
    /// A floor of `min_propensity` with the default number of draws.
    #[must_use]
    pub fn new(min_propensity: f64) -> ExplorationFloorConfig {
        ExplorationFloorConfig {
            min_propensity,
            ..ExplorationFloorConfig::default()
        }
    }

    /// Checks the ranges.
    ///
    /// # Errors
    /// `min_propensity` outside `[0, 0.5]` or too many draws.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        if !(0.0..=0.5).contains(&self.min_propensity) {
            return Err(crate::error::out_of_range(
                "min_propensity",
                self.min_propensity,
                "must be in [0, 0.5]: the least probability of going first each eligible \
                 candidate keeps (e.g. 0.01; 0 turns the floor off)",
            ));
        }
        super::ts_deadline::check_propensity_samples(self.propensity_samples)
    }

    /// Whether the floor does anything.
    #[must_use]
    pub fn is_active(&self) -> bool {
        self.min_propensity > 0.0
    }
}

/// Any policy with an exploration floor.
#[derive(Debug)]
pub struct ExplorationFloor {
    inner: Box<dyn Policy>,
    cfg: ExplorationFloorConfig,
}

impl Clone for ExplorationFloor {
    fn clone(&self) -> Self {
        ExplorationFloor {
            inner: self.inner.clone_box(),
            cfg: self.cfg,
        }
    }
}

impl ExplorationFloor {
    /// Wraps `inner`.
    ///
    /// # Errors
    /// The floor's parameters are out of range.
    pub fn new(
        inner: Box<dyn Policy>,
        cfg: ExplorationFloorConfig,
    ) -> Result<ExplorationFloor, crate::ConfigError> {
        cfg.validate()?;
        Ok(ExplorationFloor { inner, cfg })
    }

    /// The wrapped policy.
    #[must_use]
    pub fn inner(&self) -> &dyn Policy {
        self.inner.as_ref()
    }

    /// The share of requests that explore uniformly among `k` eligible candidates.
    fn mix(&self, k: usize) -> f64 {
        (k as f64 * self.cfg.min_propensity).min(1.0)
    }
}

impl Policy for ExplorationFloor {
    fn kind(&self) -> PolicyKind {
        self.inner.kind()
    }

    fn rank(&self, ctx: &RankContext<'_>, rng: &mut dyn RngCore) -> Ranking {
        let mut r = self.inner.rank(ctx, rng);
        let k = ctx.eligible.len();
        let Some(policy_first) = r.order.first().map(|s| s.index) else {
            return r;
        };
        let w = self.mix(k);
        let u: f64 = rng.random();
        let chosen = if u < w {
            ctx.eligible[((u / w * k as f64) as usize).min(k - 1)]
        } else {
            policy_first
        };
        // The mixture is exact when the policy's part is; estimated when that one is.
        let (p_policy, kind) = match r.propensity {
            Some(p) if chosen == policy_first => (p.probability, p.kind),
            // A deterministic policy's 1: every other candidate had 0.
            Some(p) if p.is_deterministic() => (0.0, p.kind),
            _ => {
                let fc =
                    self.inner
                        .first_choice_distribution(ctx, rng, self.cfg.propensity_samples);
                (fc.probability(chosen), fc.kind)
            }
        };
        let kind = match kind {
            PropensityKind::Deterministic if w > 0.0 => PropensityKind::Exact,
            kind => kind,
        };
        if chosen != policy_first {
            if let Some(pos) = r.order.iter().position(|s| s.index == chosen) {
                let moved = r.order.remove(pos);
                r.order.insert(0, moved);
            }
        }
        r.propensity = Some(Propensity {
            probability: (1.0 - w) * p_policy + w / k as f64,
            kind,
        });
        r
    }

    fn first_choice_distribution(
        &self,
        ctx: &RankContext<'_>,
        rng: &mut dyn RngCore,
        draws: u32,
    ) -> FirstChoice {
        let mut fc = self.inner.first_choice_distribution(ctx, rng, draws);
        let k = ctx.eligible.len();
        if k == 0 {
            return fc;
        }
        let w = self.mix(k);
        for p in &mut fc.probabilities {
            *p *= 1.0 - w;
        }
        for &i in ctx.eligible {
            fc.probabilities[i] += w / k as f64;
        }
        if fc.kind == PropensityKind::Deterministic && w > 0.0 {
            fc.kind = PropensityKind::Exact;
        }
        fc
    }

    fn observe_attempt(&mut self, obs: &AttemptObservation<'_>) {
        self.inner.observe_attempt(obs);
    }

    fn observe_quality(&mut self, obs: &QualityObservation<'_>) {
        self.inner.observe_quality(obs);
    }

    fn recovered(&mut self, candidate: usize, now: crate::Timestamp) {
        self.inner.recovered(candidate, now);
    }

    fn export_state(&self) -> PolicyState {
        self.inner.export_state()
    }

    fn merge_state(&mut self, other: &PolicyState) -> Result<(), StateError> {
        self.inner.merge_state(other)
    }

    fn deadline_miss_estimate(&self, candidate: usize, ctx: &RankContext<'_>) -> Option<f64> {
        self.inner.deadline_miss_estimate(candidate, ctx)
    }

    fn take_slice_evictions(&mut self) -> u64 {
        self.inner.take_slice_evictions()
    }

    fn take_quality_shifts(&mut self) -> Vec<super::QualityShift> {
        self.inner.take_quality_shifts()
    }

    fn quality_observations(&self) -> Option<Vec<u64>> {
        self.inner.quality_observations()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::Candidate;
    use crate::policies::{PolicyConfig, Static};
    use rand::SeedableRng;

    fn pool(k: usize) -> Vec<Candidate> {
        (0..k)
            .map(|i| Candidate::new(&format!("c{i}"), "p", "m"))
            .collect()
    }

    #[test]
    fn a_floored_static_policy_reports_the_mixed_propensity() {
        // K = 4, floor 0.05: w = 0.2. Static puts c2 first: P(c2) = 0.8·1 + 0.05 = 0.85, the
        // others 0.05 each.
        let cands = pool(4);
        let floored =
            ExplorationFloor::new(Box::new(Static::new(2)), ExplorationFloorConfig::new(0.05))
                .unwrap();
        let eligible = [0, 1, 2, 3];
        let ctx = RankContext::new(&cands, &eligible, &[]);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let fc = floored.first_choice_distribution(&ctx, &mut rng, 1);
        assert_eq!(fc.kind, PropensityKind::Exact);
        for (i, want) in [0.05, 0.05, 0.85, 0.05].into_iter().enumerate() {
            assert!((fc.probabilities[i] - want).abs() < 1e-12, "{i}: {fc:?}");
        }
        // Over many rankings the first choice follows that distribution and each ranking
        // reports the probability of its own first choice.
        let mut counts = [0usize; 4];
        let n = 20_000;
        for _ in 0..n {
            let r = floored.rank(&ctx, &mut rng);
            let first = r.order[0].index;
            counts[first] += 1;
            let want = if first == 2 { 0.85 } else { 0.05 };
            let p = r.propensity.unwrap();
            assert!((p.probability - want).abs() < 1e-12);
            assert_eq!(
                p.kind,
                PropensityKind::Exact,
                "a floor makes static's 1 exact"
            );
            let mut idx: Vec<usize> = r.indices().collect();
            idx.sort_unstable();
            assert_eq!(idx, eligible);
        }
        let share2 = counts[2] as f64 / f64::from(n);
        assert!((share2 - 0.85).abs() < 0.01, "{share2}");
        assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
    }

    #[test]
    fn a_floored_thompson_policy_keeps_every_candidate_above_the_floor() {
        let cands = pool(3);
        let inner = PolicyConfig::from_name("lqm-ts")
            .unwrap()
            .build(&cands, 8)
            .unwrap();
        let floored = ExplorationFloor::new(inner, ExplorationFloorConfig::new(0.02)).unwrap();
        let ctx = RankContext::new(
            &cands,
            &[0, 1, 2],
            &[0.5, 0.1, 0.0, 0.2, 0.0, 0.0, 0.3, 0.1],
        );
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let fc = floored.first_choice_distribution(&ctx, &mut rng, 200);
        assert!(matches!(fc.kind, PropensityKind::Estimated { draws: 200 }));
        let total: f64 = fc.probabilities.iter().sum();
        assert!((total - 1.0).abs() < 1e-9);
        assert!(
            fc.probabilities.iter().all(|&p| p >= 0.02 - 1e-12),
            "{fc:?}"
        );
        let p = floored.rank(&ctx, &mut rng).propensity.unwrap();
        assert!((0.02..=1.0).contains(&p.probability));
        // The mixture is only as exact as the Thompson part it mixes.
        assert!(matches!(p.kind, PropensityKind::Estimated { .. }), "{p:?}");
    }

    #[test]
    fn a_floor_out_of_range_names_the_field() {
        let e = ExplorationFloor::new(Box::new(Static::new(0)), ExplorationFloorConfig::new(0.7))
            .unwrap_err()
            .to_string();
        assert!(e.contains("min_propensity"), "{e}");
    }
}
