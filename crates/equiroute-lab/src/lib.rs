//! # equiroute-lab
//!
//! The laboratory: a simulated world of providers ([`world`]), a library of scenarios
//! ([`scenario`]), a runner that drives the core's eligibility, breakers, executor and policies
//! in virtual time ([`runner`]), and reports over seeds ([`report`]).
//!
//! ```
//! let spec = equiroute_lab::scenario::builtin("strategyqa-hetero").unwrap();
//! let run = equiroute_lab::runner::run(&spec, "lqm", 1, 300).unwrap();
//! assert_eq!(run.rounds, 300);
//! assert!((0.0..=1.0).contains(&run.quality));
//! ```

pub mod calibration;
pub mod ope;
pub mod report;
pub mod runner;
pub mod scenario;
pub use equiroute_toml as toml_text;
pub mod traffic;
pub mod world;
