//! Change detection on one candidate's quality scores: a two-sided CUSUM (Page, 1954) on the
//! residual of each score against the quality head's prediction for its query, made before
//! the head learns it, in units of the residuals' own spread.
//!
//! ```text
//! r = u − û(x)                    the residual (û: the head's centred estimate)
//! s = max(floor, sqrt(Σr²/n))     the residuals' spread before this score
//! z = r/s
//! S⁻ ← max(0, S⁻ − z − k)         evidence that the scores fell
//! S⁺ ← max(0, S⁺ + z − k)         evidence that they rose
//! alarm when S⁻ > h or S⁺ > h (once n ≥ min_scores residuals set the spread)
//! ```
//!
//! `k` (the slack) is half the shift, in spreads, the test is tuned to; `h` the threshold;
//! `z` is clipped at ±3 ([`Z_CLIP`]), so no single score can raise an alarm, and the skewed
//! tails of real scores (a 0 of an accuracy metric among 1s, an F1 near 1) count as three
//! spreads at most. Defaults `k = 0.5`, `h = 12`, 30 residuals, a spread of at least 0.1,
//! chosen in the laboratory (docs/policies.md, "Quality that changes"): Siegmund's
//! approximation for Gaussian residuals gives about 10⁶ scores between false alarms on each
//! side; a shift of 2.5 spreads (a quality ×0.5 on a provider at 0.8 with F1-like scores) is
//! found after about 6.5 scores, a shift of one spread after about 24. The scores since the
//! alarming statistic last left 0 are the run: the change's estimated start, and the
//! evidence kept after it.
//!
//! The spread adds each residual winsorised at 3 spreads, after the step, so a long shift
//! widens it slowly and one wild score does not. A merged detector adds the other's spread
//! and keeps its own statistics (each instance's evidence of a change is its own).

use serde::{Deserialize, Serialize};

/// The most spreads one residual moves a statistic by (`|z|` is clipped there).
pub const Z_CLIP: f64 = 3.0;

/// Parameters of the change detector.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShiftConfig {
    /// The threshold `h` in spreads (0 turns detection off).
    pub threshold: f64,
    /// The slack `k` in spreads: half the smallest shift the test is tuned to.
    pub slack: f64,
    /// Residuals that set the spread before the test runs.
    pub min_scores: u32,
    /// The least spread assumed (scores lie in [0, 1]; an exact judge must not make every
    /// residual a shift).
    pub spread_floor: f64,
}

impl Default for ShiftConfig {
    fn default() -> Self {
        ShiftConfig {
            threshold: 12.0,
            slack: 0.5,
            min_scores: 30,
            spread_floor: 0.1,
        }
    }
}

impl ShiftConfig {
    /// Whether detection is on.
    #[must_use]
    pub fn active(&self) -> bool {
        self.threshold > 0.0
    }

    /// Checks the ranges.
    ///
    /// # Errors
    /// A field outside its range, named.
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        crate::error::non_negative("shift.threshold", self.threshold)?;
        crate::error::non_negative("shift.slack", self.slack)?;
        crate::error::positive("shift.spread_floor", self.spread_floor)?;
        Ok(())
    }
}

/// Which way the scores moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ShiftDirection {
    Down,
    Up,
}

impl ShiftDirection {
    /// `down` or `up`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            ShiftDirection::Down => "down",
            ShiftDirection::Up => "up",
        }
    }
}

/// A detected shift: its direction and the run behind it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Alarm {
    pub direction: ShiftDirection,
    /// Scores in the run (the change's estimated start to the alarm, the alarm included).
    pub scores: u64,
    /// Their mean.
    pub run_mean: f64,
}

/// One side's statistic and its run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Side {
    /// `S`, in spreads.
    pub statistic: f64,
    /// Scores since `S` last left 0.
    pub run: u64,
    /// Their sum.
    pub run_sum: f64,
}

impl Side {
    /// One step with the increment `step` (`−z − k` or `z − k`) for score `u`.
    fn step(&mut self, step: f64, u: f64) {
        let s = self.statistic + step;
        if s > 0.0 {
            if self.statistic <= 0.0 {
                self.run = 0;
                self.run_sum = 0.0;
            }
            self.statistic = s;
            self.run += 1;
            self.run_sum += u;
        } else {
            *self = Side::default();
        }
    }
}

/// The two-sided CUSUM of one candidate (module docs).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ShiftDetector {
    /// Residuals seen.
    pub residuals: f64,
    /// Their (winsorised) sum of squares.
    pub residual_sq: f64,
    pub down: Side,
    pub up: Side,
}

impl ShiftDetector {
    /// The residuals' spread `max(floor, sqrt(Σr²/n))`.
    #[must_use]
    pub fn spread(&self, cfg: &ShiftConfig) -> f64 {
        if self.residuals > 0.0 {
            (self.residual_sq / self.residuals)
                .sqrt()
                .max(cfg.spread_floor)
        } else {
            cfg.spread_floor
        }
    }

    /// Whether enough residuals set the spread for the test to run.
    #[must_use]
    pub fn armed(&self, cfg: &ShiftConfig) -> bool {
        self.residuals >= f64::from(cfg.min_scores)
    }

    /// Folds in score `u` whose residual against the head's prediction is `residual`; an
    /// alarm restarts both statistics.
    pub fn observe(&mut self, residual: f64, u: f64, cfg: &ShiftConfig) -> Option<Alarm> {
        let spread = self.spread(cfg);
        let mut alarm = None;
        if cfg.active() && self.armed(cfg) {
            // Winsorised: one wild score (a 0 of an accuracy metric among 1s, the long tail
            // of a skewed F1) cannot raise an alarm alone.
            let z = (residual / spread).clamp(-Z_CLIP, Z_CLIP);
            self.down.step(-z - cfg.slack, u);
            self.up.step(z - cfg.slack, u);
            for (side, direction) in [
                (self.down, ShiftDirection::Down),
                (self.up, ShiftDirection::Up),
            ] {
                if side.statistic > cfg.threshold && alarm.is_none() {
                    alarm = Some(Alarm {
                        direction,
                        scores: side.run,
                        run_mean: side.run_sum / side.run as f64,
                    });
                }
            }
            if alarm.is_some() {
                self.down = Side::default();
                self.up = Side::default();
            }
        }
        let bound = 3.0 * spread;
        let r = residual.clamp(-bound, bound);
        self.residuals += 1.0;
        self.residual_sq += r * r;
        alarm
    }

    /// Whether the scores lean upward by at least `level` spreads (`S⁺ ≥ level`).
    #[must_use]
    pub fn leaning_up(&self, level: f64) -> bool {
        self.up.statistic >= level
    }

    /// Adds another instance's detector: the spreads' sums add, the statistics stay this
    /// instance's.
    pub fn merge(&mut self, other: &ShiftDetector) {
        self.residuals += other.residuals;
        self.residual_sq += other.residual_sq;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test configuration: `h = 8`, `k = 0.5`, 20 residuals to arm, spread floor 0.2.
    fn cfg() -> ShiftConfig {
        ShiftConfig {
            threshold: 8.0,
            slack: 0.5,
            min_scores: 20,
            spread_floor: 0.2,
        }
    }

    /// Twenty residuals of ±0.05 (spread 0.05, below the floor 0.2), then scores 0.4 below
    /// the prediction: each is z = −0.4/0.2 = −2, so `S⁻` climbs by 1.5 a score: 1.5, 3,
    /// 4.5, 6, 7.5, 9 > 8 at the sixth (the residuals' RMS is then
    /// sqrt((20·0.05² + 5·0.4²)/25) = 0.184, still below the floor). The run is the six.
    #[test]
    fn a_drop_of_two_spreads_is_found_at_the_sixth_score() {
        let c = cfg();
        let mut d = ShiftDetector::default();
        for n in 0..20 {
            let r = if n % 2 == 0 { 0.05 } else { -0.05 };
            assert_eq!(d.observe(r, 0.8 + r, &c), None);
        }
        assert!(d.armed(&c));
        for n in 1..=5 {
            assert_eq!(d.observe(-0.4, 0.4, &c), None, "score {n}");
            assert!((d.down.statistic - 1.5 * f64::from(n)).abs() < 1e-12);
        }
        let alarm = d.observe(-0.4, 0.4, &c).unwrap();
        assert_eq!(alarm.direction, ShiftDirection::Down);
        assert_eq!(alarm.scores, 6);
        assert!((alarm.run_mean - 0.4).abs() < 1e-12);
        // Restarted.
        assert_eq!((d.down, d.up), (Side::default(), Side::default()));
    }

    /// The same rise is found the same way on the other side.
    #[test]
    fn a_rise_is_found_on_the_upper_side() {
        let c = cfg();
        let mut d = ShiftDetector::default();
        for n in 0..20 {
            let r = if n % 2 == 0 { 0.05 } else { -0.05 };
            d.observe(r, 0.4 + r, &c);
        }
        let alarms: Vec<Option<Alarm>> = (0..6).map(|_| d.observe(0.4, 0.8, &c)).collect();
        assert!(alarms[..5].iter().all(Option::is_none));
        assert_eq!(
            alarms[5].map(|a| (a.direction, a.scores)),
            Some((ShiftDirection::Up, 6))
        );
    }

    /// Before `min_scores` residuals nothing is tested, however large.
    #[test]
    fn nothing_is_tested_before_the_spread_is_known() {
        let c = cfg();
        let mut d = ShiftDetector::default();
        for _ in 0..19 {
            assert_eq!(d.observe(-0.9, 0.0, &c), None);
        }
        assert_eq!((d.down.statistic, d.up.statistic), (0.0, 0.0));
    }

    /// A stationary stream (Gaussian residuals, sd 0.15, fixed seed) of 20,000 scores with
    /// the defaults (h = 12, k = 0.5): no alarm. And a step of −0.375 (2.5 sd) in the same
    /// stream is found within 12 scores (each moves `S⁻` by at most 3 − 0.5 = 2.5, so never
    /// before the fifth).
    #[test]
    fn no_alarm_on_a_stationary_stream_and_a_step_found_within_twelve_scores() {
        use rand::SeedableRng;
        use rand_distr::{Distribution, Normal};
        let c = ShiftConfig::default();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let noise = Normal::new(0.0, 0.15).unwrap();
        let mut d = ShiftDetector::default();
        for n in 0..20_000 {
            let r = noise.sample(&mut rng);
            assert_eq!(d.observe(r, 0.7 + r, &c), None, "false alarm at score {n}");
        }
        let spread = d.spread(&c);
        assert!((spread - 0.15).abs() < 0.005, "{spread}");
        let found = (1..=12).find(|_| {
            let r = noise.sample(&mut rng) - 0.375;
            d.observe(r, 0.7 + r, &c).is_some()
        });
        assert!(found.is_some(), "not found within 12 scores");
    }

    #[test]
    fn out_of_range_settings_name_the_field() {
        let bad = ShiftConfig {
            threshold: -1.0,
            ..ShiftConfig::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("shift.threshold"));
        let bad = ShiftConfig {
            spread_floor: 0.0,
            ..ShiftConfig::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("shift.spread_floor"));
    }
}
