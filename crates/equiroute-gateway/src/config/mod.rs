//! Gateway configuration: TOML parsed into raw structs (unknown fields are errors), then
//! validated by [`load`] into types that cannot be wrong: every interface has at least one
//! provider, ids are unique, policies are built and checked, secrets are read from the
//! environment by name and never printed. Errors name the file, the field and the fix.
//!
//! One file per job, each using only the ones listed before it: `defaults` (defaults and
//! bounds), `secrets` (secrets read from the environment), `problems` (how problems are
//! reported), `checks` (names, task classes, refused policies), the sections' own files
//! (`keys`, `state`, `telemetry`, `rollout`, `first_byte`, `tls`), `types` (the validated
//! configuration), then the raw tables with their checks: `server`, `providers` (and the
//! judge), `interfaces`, and `loader` (the `load` function) on top; `source` reads the
//! configuration again for a reload.

mod checks;
mod defaults;
pub mod first_byte;
mod interfaces;
mod keys;
mod loader;
mod problems;
mod providers;
mod rollout;
mod secrets;
mod server;
mod source;
mod state;
mod telemetry;
pub mod tls;
mod types;

pub use defaults::{
    anthropic_defaults, AZURE_DEFAULT_API_VERSION, DEFAULT_CONFIG, DEFAULT_JUDGE_PROMPT,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_SHUTDOWN_GRACE, MAX_MAX_HEADER_BYTES, MAX_TASK_CLASS_BYTES, MIN_MAX_HEADER_BYTES,
};
pub use keys::{valid_tenant, FeedbackRate, KeyConfig, KeyGrant, KeyRole, TENANT_FIX};
pub use loader::{load, load_all};
pub use problems::ConfigError;
pub use rollout::{GuardConfig, RolloutConfig};
pub use secrets::{AwsCredentials, Secret};
pub use source::{ConfigSource, Overrides};
pub use state::{default_state_file, RedisStateConfig, StateConfig, StoreConfig};
pub use telemetry::TelemetryConfig;
pub use tls::TlsConfig;
pub use types::{
    AuditConfig, AuditFeatures, AzureAuth, Caps, ConnectionLimits, GatewayConfig, InterfaceConfig,
    InterfaceKind, JudgeConfig, LogFormat, ProviderConfig, ProviderKind, SimSpec,
    UnsupportedParams, UpstreamConfig,
};

/// The environment of the unit tests that read none.
#[cfg(test)]
fn no_env(_: &str) -> Option<String> {
    None
}
