//! Errors of the core, by domain. Each message names the field and says how to fix it.

use thiserror::Error;

/// A policy, featurizer or estimator was configured with values it cannot work with.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ConfigError {
    /// The policy name is not one of the known policies.
    #[error("unknown policy `{name}`: valid policies are {valid}")]
    UnknownPolicy { name: String, valid: String },
    /// A numeric parameter is outside its allowed range.
    #[error("`{field}` = {value}: {fix}")]
    OutOfRange {
        field: &'static str,
        value: String,
        fix: &'static str,
    },
    /// A parameter names a candidate that the interface does not have.
    #[error("`{field}` names candidate `{id}`, which is not configured: use one of {valid}")]
    UnknownCandidate {
        field: &'static str,
        id: String,
        valid: String,
    },
    /// A feature vector has the wrong dimension.
    #[error("feature vector has {got} dimensions but the interface expects {expected}: pass exactly {expected} numbers or omit `features` to let Equiroute featurize the query")]
    FeatureDimension { expected: usize, got: usize },
    /// A feature vector contains NaN or an infinity.
    #[error("feature vector element {index} is not a finite number: send finite numbers only")]
    FeatureNotFinite { index: usize },
    /// An interface was configured without candidates.
    #[error("the policy needs at least one candidate: add a provider to the interface")]
    NoCandidates,
}

/// Exported learning state could not be merged into a policy.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum StateError {
    /// The state belongs to a different policy.
    #[error("state of policy `{found}` cannot be merged into policy `{expected}`: export and import state between instances of the same policy")]
    WrongPolicy { expected: String, found: String },
    /// Dimensions or candidate counts differ.
    #[error("state shape differs ({what}): both sides must have the same candidates and feature dimension")]
    Shape { what: String },
    /// This policy keeps no statistics that can be merged exactly.
    #[error("policy `{policy}` keeps no mergeable statistics")]
    NotMergeable { policy: String },
}

pub(crate) fn out_of_range(
    field: &'static str,
    value: impl std::fmt::Display,
    fix: &'static str,
) -> ConfigError {
    ConfigError::OutOfRange {
        field,
        value: value.to_string(),
        fix,
    }
}

/// Checks `value` is finite and `> 0`.
pub(crate) fn positive(field: &'static str, value: f64) -> Result<f64, ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(out_of_range(
            field,
            value,
            "must be a finite number greater than 0",
        ))
    }
}

/// Checks `value` is finite and `>= 0`.
pub(crate) fn non_negative(field: &'static str, value: f64) -> Result<f64, ConfigError> {
    if value.is_finite() && value >= 0.0 {
        Ok(value)
    } else {
        Err(out_of_range(
            field,
            value,
            "must be a finite number of at least 0",
        ))
    }
}

/// Checks `value` is in `[0, 1]`.
pub(crate) fn unit_interval(field: &'static str, value: f64) -> Result<f64, ConfigError> {
    if (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(out_of_range(field, value, "must be between 0 and 1"))
    }
}
