//! The configuration's defaults and bounds: the embedded default file, the judge's prompt,
//! the hosted providers' defaults, and the limits that values are checked against.

use std::time::Duration;

/// Defaults of `kind = "anthropic"` providers (here, below the upstreams that use them).
pub mod anthropic_defaults {
    /// The `anthropic-version` header sent when the configuration names none.
    pub const DEFAULT_VERSION: &str = "2023-06-01";

    /// The `max_tokens` sent when the client gives none and the provider's configuration
    /// neither.
    pub const DEFAULT_MAX_TOKENS: u32 = 4096;
}

/// The embedded default: two interfaces of in-process simulated providers, so that
/// `equiroute serve` routes for real on a fresh machine with no keys and no services.
pub const DEFAULT_CONFIG: &str = include_str!("default.toml");

/// The judge's default prompt (`{question}` and `{answer}` are filled in); the judge reads it
/// from here so that the configuration needs nothing of the judge.
pub const DEFAULT_JUDGE_PROMPT: &str = "You grade answers. Reply with one number between 0 and 1: how well the answer serves the question (1 = fully correct and useful, 0 = useless).\n\nQuestion:\n{question}\n\nAnswer:\n{answer}\n\nScore:";

/// The Azure OpenAI `api-version` sent when the configuration names none (a GA version).
pub const AZURE_DEFAULT_API_VERSION: &str = "2024-10-21";

/// The longest task class (`x-equiroute-task-class`) taken from a header, in bytes; a longer
/// one is treated as none and counted in `equiroute_task_class_too_long_total`. The class
/// is hashed into a slice key and never stored, but a client's text is bounded wherever it
/// goes, and a name this long is no class an operator declared.
pub const MAX_TASK_CLASS_BYTES: usize = 64;

/// The longest interface name or provider id.
pub(super) const MAX_NAME_LEN: usize = 64;

/// The default `max_body_bytes`: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;

/// The default `max_header_bytes`: 32 KiB, far above what clients send (a few hundred
/// bytes; a long bearer key or trace context stays under 4 KiB).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 32 << 10;
/// The smallest `max_header_bytes`: hyper's smallest read buffer.
pub const MIN_MAX_HEADER_BYTES: usize = 8 << 10;
/// The largest `max_header_bytes`.
pub const MAX_MAX_HEADER_BYTES: usize = 1 << 20;
/// The default `max_buffered_bytes` (or twice `max_body_bytes`, if more).
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 64 << 20;

/// The default `server.shutdown_grace_ms`: 20 s, so that the drain, Redis's last push (at
/// most 5 s) and the snapshot fit in the 30 s an orchestrator (Kubernetes'
/// `terminationGracePeriodSeconds`) waits before it kills the process.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// The longest connection timeout accepted: a day (longer is surely a typo, and would
/// overflow the clock's arithmetic at absurd values).
pub(super) const MAX_CONNECTION_TIMEOUT_MS: f64 = 86_400_000.0;
