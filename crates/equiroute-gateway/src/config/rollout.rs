//! An interface's `shadow` policy and `rollout` (canary) table: parsed, then validated into
//! [`RolloutConfig`] (see docs/rollout.md).

use equiroute_core::policies::PolicyConfig;
use equiroute_core::Candidate;
use serde::Deserialize;

/// `rollout = { policy = …, percent = 5, guard = { … } }` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRollout {
    /// The candidate policy, written like the interface's `policy` (a name or a table).
    policy: PolicyConfig,
    /// Share of the requests (by the hash of their session key) routed by the candidate.
    percent: f64,
    #[serde(default)]
    guard: RawGuard,
}

/// The rollback guard's knobs; absent fields keep their defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGuard {
    bad_rate_margin: Option<f64>,
    quality_margin: Option<f64>,
    confidence: Option<f64>,
    tuned_for: Option<u64>,
}

/// A validated canary rollout.
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutConfig {
    pub policy: PolicyConfig,
    /// Share of the requests in `(0, 100)`.
    pub percent: f64,
    pub guard: GuardConfig,
}

/// When a canary is rolled back automatically.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GuardConfig {
    /// Rolled back once its bad-outcome rate (failed or past the deadline) is above the live
    /// arm's by more than this, with `confidence`.
    pub bad_rate_margin: f64,
    /// Rolled back once its mean quality is below the live arm's by more than this.
    pub quality_margin: f64,
    /// Probability of no false rollback over the whole rollout, however often it is checked.
    pub confidence: f64,
    /// Candidate requests at which the test is sharpest.
    pub tuned_for: u64,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            bad_rate_margin: 0.05,
            quality_margin: 0.05,
            confidence: 0.95,
            tuned_for: 200,
        }
    }
}

/// Validates a `rollout` table against the interface's candidates; errors are (field, fix)
/// with the field relative to `rollout`.
pub(super) fn validate(
    raw: RawRollout,
    candidates: &[Candidate],
    feature_dim: usize,
) -> Result<RolloutConfig, (String, String)> {
    check_policy(&raw.policy, candidates, feature_dim).map_err(|fix| ("policy".into(), fix))?;
    if !(raw.percent.is_finite() && raw.percent > 0.0 && raw.percent < 100.0) {
        return Err((
            "percent".into(),
            "must be a share of the requests above 0 and below 100, e.g. 5 (to move every request, change `policy` instead)".into(),
        ));
    }
    let d = GuardConfig::default();
    let margin = |v: Option<f64>, name: &str, default: f64| match v {
        None => Ok(default),
        Some(m) if m.is_finite() && (0.0..1.0).contains(&m) => Ok(m),
        Some(_) => Err((
            format!("guard.{name}"),
            format!("must be a difference in [0, 1), e.g. {default} (the default)"),
        )),
    };
    let guard = GuardConfig {
        bad_rate_margin: margin(
            raw.guard.bad_rate_margin,
            "bad_rate_margin",
            d.bad_rate_margin,
        )?,
        quality_margin: margin(raw.guard.quality_margin, "quality_margin", d.quality_margin)?,
        confidence: match raw.guard.confidence {
            None => d.confidence,
            Some(c) if (0.5..1.0).contains(&c) => c,
            Some(_) => {
                return Err((
                    "guard.confidence".into(),
                    "must be a probability in [0.5, 1), e.g. 0.95 (the default)".into(),
                ))
            }
        },
        tuned_for: match raw.guard.tuned_for {
            None => d.tuned_for,
            Some(n) if n >= 1 => n,
            Some(_) => {
                return Err((
                    "guard.tuned_for".into(),
                    "must be at least 1 candidate request (default 200)".into(),
                ))
            }
        },
    };
    Ok(RolloutConfig {
        policy: raw.policy,
        percent: raw.percent,
        guard,
    })
}

/// Validates an interface's `shadow` and `rollout`; errors are (field, fix) with the field
/// relative to the interface.
pub(super) fn side_policies(
    shadow: Option<&PolicyConfig>,
    rollout: Option<RawRollout>,
    candidates: &[Candidate],
    feature_dim: usize,
) -> Result<Option<RolloutConfig>, (String, String)> {
    if let Some(shadow) = shadow {
        check_policy(shadow, candidates, feature_dim).map_err(|fix| ("shadow".to_owned(), fix))?;
    }
    rollout
        .map(|r| validate(r, candidates, feature_dim))
        .transpose()
        .map_err(|(f, fix)| (format!("rollout.{f}"), fix))
}

/// A side policy (shadow or candidate) builds on this interface and is not laboratory-only.
pub(super) fn check_policy(
    policy: &PolicyConfig,
    candidates: &[Candidate],
    feature_dim: usize,
) -> Result<(), String> {
    super::checks::refuse_laboratory_policies(policy)?;
    policy
        .build(candidates, feature_dim)
        .map(|_| ())
        .map_err(|e| e.to_string())
}
