//! Observations as values: what a policy learnt from, in a form that can be stored, sent to
//! another gateway instance and replayed there. Replaying the same observations in the same
//! order on the same starting state gives the same statistics, for every policy (windows and
//! moving averages included); for the sums of sufficient statistics the order does not matter.

use super::{AttemptObservation, Policy, QualityObservation};
use crate::decision::{AttemptOutcome, Millis, SlicePath, Timestamp};
use serde::{Deserialize, Serialize};

/// One thing a policy learns from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Observation {
    /// A finished attempt (see [`AttemptObservation`]).
    Attempt {
        candidate: usize,
        features: Vec<f64>,
        slice: SlicePath,
        deadline: Option<Millis>,
        outcome: AttemptOutcome,
        now: Timestamp,
    },
    /// A delayed quality score (see [`QualityObservation`]).
    Quality {
        candidate: usize,
        features: Vec<f64>,
        quality: f64,
        latency: Millis,
        now: Timestamp,
    },
    /// The candidate's circuit breaker saw it recover (see [`Policy::recovered`]).
    Recovered { candidate: usize, now: Timestamp },
}

impl Observation {
    /// The owned form of an attempt observation.
    #[must_use]
    pub fn attempt(obs: &AttemptObservation<'_>) -> Observation {
        Observation::Attempt {
            candidate: obs.candidate,
            features: obs.features.to_vec(),
            slice: obs.slice,
            deadline: obs.deadline,
            outcome: *obs.outcome,
            now: obs.now,
        }
    }

    /// The owned form of a quality observation.
    #[must_use]
    pub fn quality(obs: &QualityObservation<'_>) -> Observation {
        Observation::Quality {
            candidate: obs.candidate,
            features: obs.features.to_vec(),
            quality: obs.quality,
            latency: obs.latency,
            now: obs.now,
        }
    }

    /// The candidate the observation is about.
    #[must_use]
    pub fn candidate(&self) -> usize {
        match self {
            Observation::Attempt { candidate, .. }
            | Observation::Quality { candidate, .. }
            | Observation::Recovered { candidate, .. } => *candidate,
        }
    }

    /// Feeds the observation to `policy`.
    pub fn apply(&self, policy: &mut dyn Policy) {
        match self {
            Observation::Attempt {
                candidate,
                features,
                slice,
                deadline,
                outcome,
                now,
            } => policy.observe_attempt(&AttemptObservation {
                candidate: *candidate,
                features,
                slice: *slice,
                deadline: *deadline,
                outcome,
                now: *now,
            }),
            Observation::Quality {
                candidate,
                features,
                quality,
                latency,
                now,
            } => policy.observe_quality(&QualityObservation {
                candidate: *candidate,
                features,
                quality: *quality,
                latency: *latency,
                now: *now,
            }),
            Observation::Recovered { candidate, now } => policy.recovered(*candidate, *now),
        }
    }
}
