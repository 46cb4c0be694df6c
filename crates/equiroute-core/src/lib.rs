//! # equiroute-core
//!
//! The pure heart of Equiroute: every routing decision comes from here. Nothing in this crate
//! performs I/O, reads a clock or owns a global random generator: time ([`Timestamp`]) and
//! randomness (`&mut dyn RngCore`) are passed in, so the gateway (real time) and the
//! laboratory (virtual time) call the same code and every run is reproducible from a seed.
//!
//! A request flows through three layers:
//!
//! 1. [`eligibility`]: deterministic filters (capabilities, tenants, labels, quality gates,
//!    budgets, circuit breakers). Every excluded candidate carries an [`ExclusionReason`].
//! 2. A [`Policy`](policies::Policy) ranks the eligible candidates; the order is the fallback
//!    order. Policies are built by name from [`PolicyConfig`](policies::PolicyConfig).
//! 3. [`executor::Execution`] walks the ranking within the deadline and attempt limit; the
//!    caller makes each attempt and feeds each [`AttemptOutcome`] and any delayed quality
//!    score back through `observe_attempt` / `observe_quality`.
//!
//! ```
//! use equiroute_core::prelude::*;
//! use rand::SeedableRng;
//!
//! let candidates = vec![
//!     Candidate::new("fast-useless", "a", "m"),
//!     Candidate::new("slow-useful", "b", "m"),
//! ];
//! let policy = PolicyConfig::from_name("lqm").unwrap().build(&candidates, 8).unwrap();
//! let features = Featurizer::new(8).unwrap().featurize("who wrote the iliad");
//! let ctx = RankContext::new(&candidates, &[0, 1], &features);
//! let mut rng = rand::rngs::StdRng::seed_from_u64(7);
//! let ranking = policy.rank(&ctx, &mut rng);
//! assert_eq!(ranking.order.len(), 2);
//! ```

pub mod breaker;
pub mod decision;
pub mod eligibility;
pub mod error;
pub mod estimators;
pub mod executor;
pub mod features;
pub mod hash;
pub mod hedge;
pub mod latency;
pub mod ope;
pub mod policies;
pub mod sequential;

pub use decision::*;
pub use error::{ConfigError, StateError};

/// Everything a caller usually needs, in one import.
pub mod prelude {
    pub use crate::breaker::{Admission, Breaker, BreakerConfig, BreakerState, Transition};
    pub use crate::decision::*;
    pub use crate::eligibility::{check_eligibility, EligibilityInput, Eligible};
    pub use crate::error::{ConfigError, StateError};
    pub use crate::executor::{
        Execution, ExecutionLimits, NextAttempt, RequestResult, RequestStatus,
    };
    pub use crate::features::Featurizer;
    pub use crate::policies::{
        AttemptObservation, ExplorationFloor, ExplorationFloorConfig, FirstChoice, Policy,
        PolicyConfig, PolicyKind, PolicyState, PropensityKind, QualityObservation, RankContext,
        Ranking, ScoreBreakdown, ScoredCandidate,
    };
}
