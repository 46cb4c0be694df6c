//! Gateway configuration: TOML parsed into raw structs (unknown fields are errors), then
//! validated by [`load`] into types that cannot be wrong: every interface has at least one
//! provider, ids are unique, policies are built and checked, secrets are read from the
//! environment by name and never printed. Errors name the file, the field and the fix.

use equiroute_core::breaker::BreakerConfig;
use equiroute_core::executor::ExecutionLimits;
use equiroute_core::latency::LatencySpec;
use equiroute_core::policies::PolicyConfig;
use equiroute_core::{Candidate, CandidateId, Capabilities, Millis, Price, ServiceTier};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

pub mod first_byte;
mod keys;
mod rollout;
mod state;
mod telemetry;

pub use keys::{valid_tenant, FeedbackRate, KeyConfig, KeyGrant, KeyRole, TENANT_FIX};
pub use rollout::{GuardConfig, RolloutConfig};

/// Defaults of `kind = "anthropic"` providers (here, below the upstreams that use them).
pub mod anthropic_defaults {
    /// The `anthropic-version` header sent when the configuration names none.
    pub const DEFAULT_VERSION: &str = "2023-06-01";

    /// The `max_tokens` sent when the client gives none and the provider's configuration
    /// neither.
    pub const DEFAULT_MAX_TOKENS: u32 = 4096;
}

pub use state::{default_state_file, RedisStateConfig, StateConfig, StoreConfig};
pub use telemetry::TelemetryConfig;

/// The embedded default: two interfaces of in-process simulated providers, so that
/// `equiroute serve` routes for real on a fresh machine with no keys and no services.
pub const DEFAULT_CONFIG: &str = include_str!("default.toml");

/// The judge's default prompt (`{question}` and `{answer}` are filled in); the judge reads it
/// from here so that the configuration needs nothing of the judge.
pub const DEFAULT_JUDGE_PROMPT: &str = "You grade answers. Reply with one number between 0 and 1: how well the answer serves the question (1 = fully correct and useful, 0 = useless).\n\nQuestion:\n{question}\n\nAnswer:\n{answer}\n\nScore:";

/// Where and how much to log.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditConfig {
    pub path: std::path::PathBuf,
    /// Rotate when the file grows past this many bytes.
    #[serde(default = "default_max_bytes")]
    pub max_bytes: u64,
    /// Rotated files kept (`path.1` … `path.N`).
    #[serde(default = "default_keep")]
    pub keep: u32,
    /// How a request's feature vector is recorded (privacy): `full`, `hash` or `none`.
    #[serde(default)]
    pub features: AuditFeatures,
}

/// How the audit log records a request's feature vector. The features are hashed words of the
/// request's text, so `full` lets a dictionary recover some of the words; `hash` keeps only a
/// stable digest (equal vectors, equal digests), enough to group requests but not to evaluate
/// a contextual policy offline; `none` keeps nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuditFeatures {
    /// The vector itself (`"features": [..]`): every policy can be replayed.
    Full,
    /// A stable 64-bit digest (`"features_hash": "16 hex digits"`).
    #[default]
    Hash,
    /// Nothing.
    None,
}

fn default_max_bytes() -> u64 {
    64 << 20
}
fn default_keep() -> u32 {
    3
}

/// What an interface serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InterfaceKind {
    /// OpenAI-compatible chat completions (`POST /v1/chat/completions`).
    Chat,
    /// A generic JSON tool call (`POST /v1/tools/{interface}`).
    Tool,
}

/// Kinds of upstream provider.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// In-process simulated provider, using the laboratory's latency and failure models.
    Sim,
    /// An OpenAI-compatible chat completions API (`{base_url}/chat/completions`).
    Openai,
    /// A JSON API called with `POST {url}` (web search, retrieval, any tool).
    Http,
    /// Anthropic's Messages API (`{base_url}/messages`).
    Anthropic,
    /// An Azure OpenAI deployment.
    AzureOpenai,
    /// Google's Gemini API (`{base_url}/models/{model}:generateContent`).
    Gemini,
    /// AWS Bedrock's Converse API (`{base_url}/model/{model}/converse`), SigV4-signed.
    Bedrock,
}

impl ProviderKind {
    /// The kind as the configuration writes it.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ProviderKind::Sim => "sim",
            ProviderKind::Openai => "openai",
            ProviderKind::Http => "http",
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::AzureOpenai => "azure_openai",
            ProviderKind::Gemini => "gemini",
            ProviderKind::Bedrock => "bedrock",
        }
    }

    /// What a model of this kind can do when the configuration does not say: the host's
    /// API's abilities (Anthropic's has no JSON mode; every hosted kind's current models take
    /// images; a self-hosted `http` server is not assumed to) and
    /// a context window typical of its current models.
    #[must_use]
    pub fn default_capabilities(self) -> Capabilities {
        let base = Capabilities::default();
        match self {
            // Converse has no JSON mode either; its models (Claude, Nova, Llama) mostly see.
            ProviderKind::Anthropic | ProviderKind::Bedrock => Capabilities {
                json_mode: false,
                vision: true,
                context_tokens: 200_000,
                ..base
            },
            ProviderKind::Gemini => Capabilities {
                vision: true,
                context_tokens: 1_048_576,
                ..base
            },
            // OpenAI's current chat models (the GPT-4o, 4.1 and 5 families) take images.
            ProviderKind::Openai | ProviderKind::AzureOpenai => Capabilities {
                vision: true,
                ..base
            },
            ProviderKind::Sim | ProviderKind::Http => base,
        }
    }
}

/// What a provider whose API cannot express a request member does with it
/// (`unsupported_params`, on an interface or a provider): members that do not change what the
/// answer means (`user`, `seed`, a message's `name`, ...; the list is
/// `upstream::dialect::DROPPABLE`) are dropped, or the request is refused with a 400 naming
/// the member. Members that change the answer (tools, JSON mode, images) are always refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnsupportedParams {
    /// Drop the members that do not change the answer's meaning, and name them in
    /// `x-equiroute-dropped-params`.
    #[default]
    Drop,
    /// Refuse every member the provider's API cannot express.
    Reject,
}

/// How an Azure OpenAI provider sends its key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AzureAuth {
    /// The `api-key` header (a resource key).
    #[default]
    ApiKey,
    /// `Authorization: Bearer` (a Microsoft Entra ID token).
    Bearer,
}

/// Capabilities as the configuration declares them: those left out take the kind's default.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCapabilities {
    tools: Option<bool>,
    json_mode: Option<bool>,
    streaming: Option<bool>,
    vision: Option<bool>,
    audio: Option<bool>,
    context_tokens: Option<u32>,
}

impl RawCapabilities {
    fn over(self, d: &Capabilities) -> Capabilities {
        Capabilities {
            tools: self.tools.unwrap_or(d.tools),
            json_mode: self.json_mode.unwrap_or(d.json_mode),
            streaming: self.streaming.unwrap_or(d.streaming),
            vision: self.vision.unwrap_or(d.vision),
            audio: self.audio.unwrap_or(d.audio),
            context_tokens: self.context_tokens.unwrap_or(d.context_tokens),
        }
    }
}

/// AWS credentials of a `bedrock` provider, read from the standard environment variables
/// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, optional `AWS_SESSION_TOKEN`). Its `Debug`
/// shows none of them.
#[derive(Clone, PartialEq, Eq)]
pub struct AwsCredentials {
    pub access_key_id: Secret,
    pub secret_access_key: Secret,
    pub session_token: Option<Secret>,
}

impl AwsCredentials {
    #[must_use]
    pub fn new(access_key_id: &str, secret_access_key: &str, session_token: Option<&str>) -> Self {
        AwsCredentials {
            access_key_id: Secret(access_key_id.to_owned()),
            secret_access_key: Secret(secret_access_key.to_owned()),
            session_token: session_token.map(|t| Secret(t.to_owned())),
        }
    }

    /// The signing crate's identity of these credentials.
    #[must_use]
    pub fn identity(&self) -> aws_smithy_runtime_api::client::identity::Identity {
        aws_credential_types::Credentials::new(
            &self.access_key_id.0,
            &self.secret_access_key.0,
            self.session_token.as_ref().map(|t| t.0.clone()),
            None,
            "environment",
        )
        .into()
    }

    /// The values that must never appear in a reply, an error or a log line.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        [
            Some(&self.access_key_id),
            Some(&self.secret_access_key),
            self.session_token.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(|s| s.0.as_str())
    }
}

impl std::fmt::Debug for AwsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AwsCredentials(<redacted>)")
    }
}

/// A secret read from the environment. Its `Debug` never shows the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    /// The decision audit log (JSON lines, size-rotated); none when absent.
    #[serde(default)]
    audit: Option<AuditConfig>,
    /// Where learning state is saved across restarts; none: in memory only.
    #[serde(default)]
    state: Option<state::RawState>,
    /// OpenTelemetry export of traces; none when absent.
    #[serde(default)]
    telemetry: Option<telemetry::RawTelemetry>,
    #[serde(default)]
    interfaces: BTreeMap<String, RawInterface>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    max_body_bytes: Option<usize>,
    /// Names of environment variables holding accepted bearer keys.
    #[serde(default)]
    api_keys_env: Vec<String>,
    /// Names of environment variables holding the keys of the state routes.
    #[serde(default)]
    admin_keys_env: Vec<String>,
    /// Keys with a tenant, task classes and a role (`[[server.keys]]`).
    #[serde(default)]
    keys: Vec<keys::RawKey>,
    /// Most feedback scores one key may post per second (a token bucket); none: no cap.
    feedback_rate_per_key: Option<f64>,
    /// Scores one key may post at once after a quiet spell; default twice the rate.
    feedback_burst_per_key: Option<f64>,
    /// How long a request's context waits for quality feedback, in seconds.
    feedback_ttl_s: Option<f64>,
    /// Most contexts kept for feedback at once.
    max_pending_feedback: Option<usize>,
    /// Threads serving requests; none: one per core.
    worker_threads: Option<usize>,
    /// Longest wait for a request's headers, from the accept or the first byte after idling.
    header_read_timeout_ms: Option<f64>,
    /// Longest wait for a request's whole body, from its headers.
    body_read_timeout_ms: Option<f64>,
    /// Longest a keep-alive connection stays open with no request in flight.
    idle_timeout_ms: Option<f64>,
    /// Longest a response write may wait for a client that does not read.
    send_timeout_ms: Option<f64>,
    /// Most client connections open at once, across every event loop.
    max_connections: Option<usize>,
    /// Most connections one client address holds at once.
    max_connections_per_address: Option<usize>,
    /// Largest request head (request line and headers), in bytes.
    max_header_bytes: Option<usize>,
    /// Most bytes of request bodies still arriving, over every connection.
    max_buffered_bytes: Option<usize>,
    /// Most of those one client address holds.
    max_buffered_bytes_per_address: Option<usize>,
    /// Most requests one gateway key has in flight at once.
    max_in_flight_per_key: Option<usize>,
    /// `human` (default) or `json` (one JSON object per line) for the logs on stderr.
    log_format: Option<String>,
    /// Longest drain after a stop signal before the streams still open are ended.
    shutdown_grace_ms: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInterface {
    kind: InterfaceKind,
    #[serde(default)]
    policy: Option<PolicyConfig>,
    /// An exploration floor: every eligible provider keeps at least this probability of
    /// going first, so that the audit log supports evaluating other policies.
    min_propensity: Option<f64>,
    deadline_ms: Option<f64>,
    max_attempts: Option<u32>,
    attempt_timeout_ms: Option<f64>,
    /// Longest silence between chunks of a streamed answer before it is ended as broken.
    stream_idle_ms: Option<f64>,
    /// When a provider error retries the same provider instead of falling over.
    retry: Option<RawRetry>,
    /// How a streamed attempt's first-byte limit is learnt from the provider.
    first_byte: Option<first_byte::FirstByteLimit>,
    /// How much of a stream is held back so that an early failure can fall back.
    stream_hold: Option<first_byte::StreamHold>,
    /// Whether a stream that breaks after it was committed goes on elsewhere.
    stream_resume: Option<first_byte::StreamResume>,
    /// An LLM-as-judge that scores a sample of answers.
    judge: Option<RawJudge>,
    feature_dim: Option<usize>,
    /// Words of a request's text that are hashed into its features.
    feature_max_words: Option<usize>,
    /// Thresholds of every provider's circuit breaker; fields left out keep their defaults.
    breaker: Option<BreakerConfig>,
    /// Task classes (`x-equiroute-task-class`) learnt in slices of their own; absent: any.
    task_classes: Option<Vec<String>>,
    /// A policy that ranks every request beside the live one, learns, and never acts.
    shadow: Option<PolicyConfig>,
    /// A candidate policy on a share of the requests, rolled back automatically.
    rollout: Option<rollout::RawRollout>,
    /// Hedged requests (docs/hedging.md); absent: off.
    hedge: Option<RawHedge>,
    /// What its providers do with request members their API cannot express (default `drop`).
    unsupported_params: Option<UnsupportedParams>,
    #[serde(default)]
    providers: Vec<RawProvider>,
}

/// `hedge = { … }` on an interface; absent fields keep their defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHedge {
    enabled: Option<bool>,
    rule: Option<equiroute_core::hedge::HedgeRule>,
    max_rate: Option<f64>,
    burst: Option<f64>,
    max_parallel: Option<u32>,
    streams: Option<bool>,
    /// Whether a call may safely run twice; tool interfaces hedge only when it is set.
    idempotent: Option<bool>,
}

/// An interface's hedging, or the problem as (field, fix).
fn hedge_config(
    raw: Option<&RawHedge>,
    kind: InterfaceKind,
) -> Result<equiroute_core::hedge::HedgeConfig, (String, String)> {
    // The gateway races streams only when asked (`streams = true`).
    let d = equiroute_core::hedge::HedgeConfig {
        streams: false,
        ..equiroute_core::hedge::HedgeConfig::default()
    };
    let Some(raw) = raw else { return Ok(d) };
    let cfg = equiroute_core::hedge::HedgeConfig {
        enabled: raw.enabled.unwrap_or(true),
        rule: raw.rule.unwrap_or(d.rule),
        max_rate: raw.max_rate.unwrap_or(d.max_rate),
        burst: raw.burst.unwrap_or(d.burst),
        max_parallel: raw.max_parallel.unwrap_or(d.max_parallel),
        streams: raw.streams.unwrap_or(d.streams),
    };
    cfg.validate().map_err(|e| match e {
        equiroute_core::ConfigError::OutOfRange { field, value, fix } => {
            (field.to_owned(), format!("{value}: {fix}"))
        }
        other => ("hedge".to_owned(), other.to_string()),
    })?;
    if cfg.enabled
        && matches!(
            cfg.rule,
            equiroute_core::hedge::HedgeRule::ObservedQuantile { .. }
        )
    {
        return Err((
            "hedge.rule".to_owned(),
            "`observed-quantile` is the laboratory's fixed-delay baseline: use `{ kind = \"priced-saving\" }` (default), `{ kind = \"deadline-risk\" }` or `{ kind = \"predictive-quantile\" }`".to_owned(),
        ));
    }
    // A tool call may act (send, write, pay): only one marked idempotent is sent twice.
    if cfg.enabled && kind == InterfaceKind::Tool && raw.idempotent != Some(true) {
        return Err((
            "hedge.idempotent".to_owned(),
            "a tool interface hedges only when its calls are safe to run twice: set `idempotent = true`, or `enabled = false`".to_owned(),
        ));
    }
    Ok(cfg)
}

/// The retry rule's knobs (`retry = { … }` on an interface); absent fields keep their
/// defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetry {
    /// Longest `Retry-After` waited out on the best-ranked provider (0: never wait).
    max_retry_after_wait_ms: Option<f64>,
    /// Whether a 5xx without `Retry-After` is retried once on the same provider.
    server_error: Option<bool>,
    /// Mean pause before that retry.
    server_error_pause_ms: Option<f64>,
    /// Spread of the pause around its mean, a fraction in [0, 1].
    jitter: Option<f64>,
}

/// An interface's limits on its attempts, or the problem as (field, fix).
fn execution_limits(
    max_attempts: Option<u32>,
    attempt_timeout_ms: Option<f64>,
    retry: Option<&RawRetry>,
) -> Result<ExecutionLimits, (String, String)> {
    let max_attempts = max_attempts.unwrap_or(3);
    if max_attempts == 0 {
        return Err(("max_attempts".into(), "must be at least 1".into()));
    }
    // Never wait forever on one provider, even without a deadline.
    let attempt_timeout = match attempt_timeout_ms {
        Some(t) if t.is_finite() && t > 0.0 => Millis(t),
        Some(_) => {
            return Err((
                "attempt_timeout_ms".into(),
                "must be a positive number of ms".into(),
            ))
        }
        None => Millis(60_000.0),
    };
    let limits = ExecutionLimits {
        max_attempts,
        attempt_timeout: Some(attempt_timeout),
        ..ExecutionLimits::default()
    };
    match retry {
        Some(retry) => retry_limits(retry, limits),
        None => Ok(limits),
    }
}

/// The execution limits of an interface's retry knobs, or the problem as (field, fix).
fn retry_limits(
    raw: &RawRetry,
    limits: ExecutionLimits,
) -> Result<ExecutionLimits, (String, String)> {
    let ms = |v: Option<f64>, field: &str, default: Millis| match v {
        None => Ok(default),
        Some(t) if t.is_finite() && (0.0..=MAX_CONNECTION_TIMEOUT_MS).contains(&t) => Ok(Millis(t)),
        Some(t) => Err((
            format!("retry.{field}"),
            format!(
                "`{t}` is not a wait: write milliseconds from 0 to 86400000 (default {})",
                default.0
            ),
        )),
    };
    let defaults = ExecutionLimits::default();
    let max_retry_after_wait = ms(
        raw.max_retry_after_wait_ms,
        "max_retry_after_wait_ms",
        defaults.max_retry_after_wait,
    )?;
    let pause = ms(
        raw.server_error_pause_ms,
        "server_error_pause_ms",
        defaults.server_error_retry.unwrap_or(Millis(50.0)),
    )?;
    let jitter = raw.jitter.unwrap_or(defaults.server_error_jitter);
    if !(0.0..=1.0).contains(&jitter) {
        return Err((
            "retry.jitter".into(),
            format!(
                "must be a fraction from 0 to 1 (default {}), got {jitter}",
                defaults.server_error_jitter
            ),
        ));
    }
    Ok(ExecutionLimits {
        max_retry_after_wait,
        server_error_retry: raw.server_error.unwrap_or(true).then_some(pause),
        server_error_jitter: jitter,
        ..limits
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProvider {
    id: String,
    kind: ProviderKind,
    model: Option<String>,
    #[serde(default)]
    tier: ServiceTier,
    #[serde(default)]
    price: Price,
    #[serde(default)]
    capabilities: RawCapabilities,
    sim: Option<SimSpec>,
    /// `openai`, `anthropic`, `gemini`: the API root, e.g. `https://api.openai.com/v1`.
    base_url: Option<String>,
    /// `azure_openai`: the resource's endpoint, e.g. `https://NAME.openai.azure.com`.
    endpoint: Option<String>,
    /// `azure_openai`: the deployment's name (default: `model`).
    deployment: Option<String>,
    /// `azure_openai`: the `api-version` query; `anthropic`: the `anthropic-version` header.
    api_version: Option<String>,
    /// `azure_openai`: `api_key` (the `api-key` header, default) or `bearer`.
    auth: Option<AzureAuth>,
    /// `anthropic`: `max_tokens` sent when the client gives none (Anthropic requires one).
    max_tokens: Option<u32>,
    /// `bedrock`: the AWS region (default: `AWS_REGION`, then `AWS_DEFAULT_REGION`).
    region: Option<String>,
    /// `http`: the endpoint to POST to.
    url: Option<String>,
    /// Name of the environment variable holding the provider's API key.
    api_key_env: Option<String>,
    /// Tenants allowed to use this provider (`x-equiroute-tenant`); absent: every tenant.
    tenants: Option<Vec<String>>,
    /// Whether the provider continues a final assistant message (default: `anthropic` only).
    assistant_prefill: Option<bool>,
    /// What the provider does with request members its API cannot express (default: the
    /// interface's).
    unsupported_params: Option<UnsupportedParams>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJudge {
    base_url: String,
    model: String,
    api_key_env: Option<String>,
    sample_rate: Option<f64>,
    prompt: Option<String>,
    timeout_ms: Option<f64>,
    max_in_flight: Option<usize>,
}

/// An LLM-as-judge, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct JudgeConfig {
    pub base_url: String,
    pub model: String,
    pub api_key: Option<Secret>,
    /// Share of answers judged.
    pub sample_rate: f64,
    /// Prompt with `{question}` and `{answer}` placeholders.
    pub prompt: String,
    pub timeout_ms: f64,
    /// Judge calls running at once; beyond that, answers go unjudged.
    pub max_in_flight: usize,
}

/// Behaviour of a simulated provider.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimSpec {
    pub latency: LatencySpec,
    /// Probability of a 500.
    #[serde(default)]
    pub failure_rate: f64,
    /// Probability of a 429 (with `Retry-After: 1`).
    #[serde(default)]
    pub rate_limit_rate: f64,
}

/// One provider of an interface, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct ProviderConfig {
    pub candidate: Candidate,
    pub upstream: UpstreamConfig,
    /// The provider continues a final assistant message (a prefill): a broken stream is
    /// continued on it with the partial answer as that message (`stream_resume`).
    pub assistant_prefill: bool,
    /// What it does with request members its API cannot express (the provider's setting,
    /// else the interface's, else `drop`).
    pub unsupported_params: UnsupportedParams,
}

/// How to reach a provider.
#[derive(Clone, Debug, PartialEq)]
pub enum UpstreamConfig {
    Sim(SimSpec),
    /// `POST {base_url}/chat/completions` with `Authorization: Bearer <key>`.
    Openai {
        base_url: String,
        api_key: Option<Secret>,
    },
    /// `POST {url}` with `Authorization: Bearer <key>`.
    Http {
        url: String,
        api_key: Option<Secret>,
    },
    /// `POST {base_url}/messages` with `x-api-key` and `anthropic-version`.
    Anthropic {
        base_url: String,
        api_key: Option<Secret>,
        version: String,
        /// Sent when the client gives no `max_tokens`.
        max_tokens: u32,
    },
    /// `POST {endpoint}/openai/deployments/{deployment}/chat/completions?api-version=...`.
    AzureOpenai {
        endpoint: String,
        deployment: String,
        api_version: String,
        api_key: Option<Secret>,
        auth: AzureAuth,
    },
    /// `POST {base_url}/models/{model}:generateContent` with `x-goog-api-key`.
    Gemini {
        base_url: String,
        api_key: Option<Secret>,
    },
    /// `POST {base_url}/model/{model}/converse` (`/converse-stream`), signed (AWS Signature Version 4).
    Bedrock {
        base_url: String,
        region: String,
        credentials: AwsCredentials,
    },
}

/// The Azure OpenAI `api-version` sent when the configuration names none (a GA version).
pub const AZURE_DEFAULT_API_VERSION: &str = "2024-10-21";

/// One interface, validated: at least one provider, a built-and-checked policy.
#[derive(Clone, Debug)]
pub struct InterfaceConfig {
    pub name: String,
    pub kind: InterfaceKind,
    pub policy: PolicyConfig,
    /// `min_propensity` (inactive at 0): the policy is wrapped in an exploration floor.
    pub exploration_floor: equiroute_core::policies::ExplorationFloorConfig,
    pub deadline: Option<Millis>,
    pub limits: ExecutionLimits,
    /// Hedged requests (off by default).
    pub hedge: equiroute_core::hedge::HedgeConfig,
    pub stream_idle: Millis,
    /// How a streamed attempt's first-byte limit is learnt (at most the attempt's timeout).
    pub first_byte: first_byte::FirstByteLimit,
    /// How much of a stream is held before anything is sent (see `StreamHold`).
    pub stream_hold: first_byte::StreamHold,
    /// How a stream that breaks after it was committed goes on (see `StreamResume`).
    pub stream_resume: first_byte::StreamResume,
    pub judge: Option<JudgeConfig>,
    pub feature_dim: usize,
    pub feature_max_words: usize,
    /// Thresholds of each provider's circuit breaker.
    pub breaker: BreakerConfig,
    /// Task classes learnt in slices of their own; others are learnt untagged. `None`: any.
    pub task_classes: Option<Vec<String>>,
    /// A policy run in shadow (ranks and learns, never acts).
    pub shadow: Option<PolicyConfig>,
    /// A canary rollout of another policy.
    pub rollout: Option<RolloutConfig>,
    pub providers: Vec<ProviderConfig>,
}

/// How the logs on stderr are written: lines for a person, or one JSON object per line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

/// The whole gateway configuration, validated.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    /// Accepted bearer keys with what each may do (values read from the environment; never
    /// printed): client and judge keys open the traffic routes, admin keys the state routes
    /// (with no admin key, the others do).
    pub keys: Vec<KeyConfig>,
    /// The cap on each key's feedback; none: no cap.
    pub feedback_rate: Option<FeedbackRate>,
    pub feedback_ttl: Millis,
    /// Most answered-request contexts kept for feedback (oldest evicted first).
    pub max_pending_feedback: usize,
    /// Threads serving requests (the async runtime's workers); `None`: one per core.
    pub worker_threads: Option<usize>,
    /// How `serve` writes its logs on stderr (`--log-format` overrides it).
    pub log_format: LogFormat,
    /// How long a client may hold a connection, and how many it may hold.
    pub connections: ConnectionLimits,
    /// After a stop signal, how long in-flight requests may finish before the rest are ended
    /// (a stream with an error event) and the snapshot saved (`server.shutdown_grace_ms`).
    pub shutdown_grace: Duration,
    pub audit: Option<AuditConfig>,
    /// Where learning state lives; none: in memory only.
    pub state: Option<StateConfig>,
    /// OTLP export of traces; none: traces stay in the process (logs only).
    pub telemetry: Option<TelemetryConfig>,
    pub interfaces: Vec<InterfaceConfig>,
    /// Fields that are accepted but have no effect (a `base_url` on a `sim` provider):
    /// `check-config` and `serve` print them; they never stop the gateway.
    pub warnings: Vec<ConfigError>,
}

impl GatewayConfig {
    /// The value of every secret the configuration holds: the gateway's and the admin keys,
    /// each provider's key or AWS credentials, each judge's key, and the Redis URL (whole,
    /// and its password). The gateway's [`Redactor`](crate::redact::Redactor) is built from
    /// these; a new [`Secret`] field belongs here too (a unit test lists them).
    #[must_use]
    pub fn secret_values(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self.keys.iter().map(|k| k.secret.0.as_str()).collect();
        for i in &self.interfaces {
            for p in &i.providers {
                match &p.upstream {
                    UpstreamConfig::Sim(_) => {}
                    UpstreamConfig::Openai { api_key, .. }
                    | UpstreamConfig::Http { api_key, .. }
                    | UpstreamConfig::Anthropic { api_key, .. }
                    | UpstreamConfig::AzureOpenai { api_key, .. }
                    | UpstreamConfig::Gemini { api_key, .. } => {
                        out.extend(api_key.iter().map(|s| s.0.as_str()));
                    }
                    UpstreamConfig::Bedrock { credentials, .. } => out.extend(credentials.values()),
                }
            }
            out.extend(
                i.judge
                    .iter()
                    .filter_map(|j| j.api_key.as_ref())
                    .map(|s| s.0.as_str()),
            );
        }
        if let Some(StateConfig::Redis(r)) = &self.state {
            out.push(&r.url.0);
            out.extend(state::url_password(&r.url.0));
        }
        out
    }
}

/// The longest task class (`x-equiroute-task-class`) taken from a header, in bytes; a longer
/// one is treated as none and counted in `equiroute_task_class_too_long_total`. The class
/// is hashed into a slice key and never stored, but a client's text is bounded wherever it
/// goes, and a name this long is no class an operator declared.
pub const MAX_TASK_CLASS_BYTES: usize = 64;

/// The default `max_body_bytes`: 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1 << 20;

/// The limits that keep a client from holding a connection forever, or more than its share
/// of connections and memory (`[server]`). A client address is an IPv4 address, or the /64
/// prefix of an IPv6 address (what one host usually holds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// A request's headers must arrive within this, counted from the accept (first request)
    /// or from the first byte after an idle spell; otherwise the connection is closed.
    pub header_read_timeout: Duration,
    /// A request's whole body must arrive within this, counted from its headers; otherwise
    /// a 408 and the connection is closed.
    pub body_read_timeout: Duration,
    /// A keep-alive connection with no request in flight is closed after this.
    pub idle_timeout: Duration,
    /// A response write that makes no progress for this long (a client that stopped
    /// reading) closes the connection, which ends the upstream call behind it.
    pub send_timeout: Duration,
    /// Most connections open at once over every event loop. When they are all taken, a
    /// newcomer takes one from the address holding the most (if that address holds more
    /// than the newcomer's would), else it gets a 503.
    pub max_connections: usize,
    /// Most connections one client address holds at once; further ones get a 429. With one
    /// request at a time per HTTP/1.1 connection, it also bounds the address's requests in
    /// flight.
    pub max_connections_per_address: usize,
    /// Largest request head (request line and headers); a larger one gets a 431. It also
    /// bounds each connection's read buffer.
    pub max_header_bytes: usize,
    /// Most bytes of request bodies still arriving, held over every connection; a body that
    /// would go beyond gets a 503.
    pub max_buffered_bytes: usize,
    /// Most of those one client address holds; a body that would go beyond gets a 429.
    pub max_buffered_bytes_per_address: usize,
    /// Most requests one configured key has in flight at once (a stream until it ends),
    /// whatever addresses and connections it uses; further ones get a 429.
    pub max_in_flight_per_key: usize,
}

/// The default `max_header_bytes`: 32 KiB, far above what clients send (a few hundred
/// bytes; a long bearer key or trace context stays under 4 KiB).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 32 << 10;
/// The smallest `max_header_bytes`: hyper's smallest read buffer.
pub const MIN_MAX_HEADER_BYTES: usize = 8 << 10;
/// The largest `max_header_bytes`.
pub const MAX_MAX_HEADER_BYTES: usize = 1 << 20;
/// The default `max_buffered_bytes` (or twice `max_body_bytes`, if more).
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 64 << 20;

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            send_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_connections_per_address: 512,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_buffered_bytes: DEFAULT_MAX_BUFFERED_BYTES,
            max_buffered_bytes_per_address: DEFAULT_MAX_BUFFERED_BYTES / 2,
            max_in_flight_per_key: 512,
        }
    }
}

/// The default `server.shutdown_grace_ms`: 20 s, so that the drain, Redis's last push (at
/// most 5 s) and the snapshot fit in the 30 s an orchestrator (Kubernetes'
/// `terminationGracePeriodSeconds`) waits before it kills the process.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// `server.shutdown_grace_ms`, or the problem with it as (field, fix).
fn shutdown_grace(raw: &RawServer) -> Result<Duration, (String, String)> {
    match raw.shutdown_grace_ms {
        None => Ok(DEFAULT_SHUTDOWN_GRACE),
        Some(ms) if ms.is_finite() && (0.0..=MAX_CONNECTION_TIMEOUT_MS).contains(&ms) => {
            Ok(Duration::from_secs_f64(ms / 1000.0))
        }
        Some(ms) => Err((
            "server.shutdown_grace_ms".into(),
            format!(
                "`{ms}` is not a grace period: write a number of milliseconds from 0 to 86400000 (default {})",
                DEFAULT_SHUTDOWN_GRACE.as_millis()
            ),
        )),
    }
}

/// The longest connection timeout accepted: a day (longer is surely a typo, and would
/// overflow the clock's arithmetic at absurd values).
const MAX_CONNECTION_TIMEOUT_MS: f64 = 86_400_000.0;

/// The `[server]` connection limits, or the problems with them as (field, fix).
/// `max_body_bytes` is the largest body, which the buffered-bytes limits must hold.
fn connection_limits(
    raw: &RawServer,
    max_body_bytes: usize,
) -> Result<ConnectionLimits, Vec<(String, String)>> {
    let defaults = ConnectionLimits::default();
    let mut problems = Vec::new();
    let shares = shares(raw, max_body_bytes, &mut problems);
    let mut timeout = |value: Option<f64>, field: &str, default: Duration| match value {
        None => default,
        Some(ms) if ms.is_finite() && ms > 0.0 && ms <= MAX_CONNECTION_TIMEOUT_MS => {
            Duration::from_secs_f64(ms / 1000.0)
        }
        Some(ms) => {
            problems.push((
                format!("server.{field}"),
                format!(
                    "`{ms}` is not a timeout: write a number of milliseconds greater than 0 and at most 86400000 (default {})",
                    default.as_millis()
                ),
            ));
            default
        }
    };
    let limits = ConnectionLimits {
        header_read_timeout: timeout(
            raw.header_read_timeout_ms,
            "header_read_timeout_ms",
            defaults.header_read_timeout,
        ),
        body_read_timeout: timeout(
            raw.body_read_timeout_ms,
            "body_read_timeout_ms",
            defaults.body_read_timeout,
        ),
        idle_timeout: timeout(
            raw.idle_timeout_ms,
            "idle_timeout_ms",
            defaults.idle_timeout,
        ),
        send_timeout: timeout(
            raw.send_timeout_ms,
            "send_timeout_ms",
            defaults.send_timeout,
        ),
        ..shares
    };
    if problems.is_empty() {
        Ok(limits)
    } else {
        Err(problems)
    }
}

/// The `[server]` limits on what one address and all of them may hold: the connections,
/// the head, the bytes of bodies still arriving, and one key's requests in flight. Defaults:
/// half of `max_connections` per address and per key; 32 KiB of head; 64 MiB of arriving bodies (at least twice `max_body_bytes`), half
/// of it per address (at least `max_body_bytes`). Timeouts are left at their defaults here.
fn shares(
    raw: &RawServer,
    max_body_bytes: usize,
    problems: &mut Vec<(String, String)>,
) -> ConnectionLimits {
    let defaults = ConnectionLimits::default();
    let mut problem = |field: &str, fix: String| problems.push((format!("server.{field}"), fix));
    let max_connections = match raw.max_connections {
        Some(0) => {
            problem(
                "max_connections",
                format!("must be at least 1 (default {})", defaults.max_connections),
            );
            defaults.max_connections
        }
        set => set.unwrap_or(defaults.max_connections),
    };
    let max_connections_per_address = match raw.max_connections_per_address {
        Some(n) if n == 0 || n > max_connections => {
            problem(
                "max_connections_per_address",
                format!("`{n}` must be from 1 to server.max_connections ({max_connections}); leave it out for half of that"),
            );
            max_connections
        }
        set => set.unwrap_or(max_connections.div_ceil(2)),
    };
    let max_in_flight_per_key = match raw.max_in_flight_per_key {
        Some(0) => {
            problem(
                "max_in_flight_per_key",
                format!(
                    "must be at least 1; leave it out for half of server.max_connections ({})",
                    max_connections.div_ceil(2)
                ),
            );
            max_connections
        }
        set => set.unwrap_or(max_connections.div_ceil(2)),
    };
    let max_header_bytes = match raw.max_header_bytes {
        Some(n) if !(MIN_MAX_HEADER_BYTES..=MAX_MAX_HEADER_BYTES).contains(&n) => {
            problem(
                "max_header_bytes",
                format!("`{n}` must be from {MIN_MAX_HEADER_BYTES} to {MAX_MAX_HEADER_BYTES} bytes (default {DEFAULT_MAX_HEADER_BYTES})"),
            );
            DEFAULT_MAX_HEADER_BYTES
        }
        set => set.unwrap_or(DEFAULT_MAX_HEADER_BYTES),
    };
    let max_buffered_bytes = raw.max_buffered_bytes.unwrap_or_else(|| {
        DEFAULT_MAX_BUFFERED_BYTES
            .max(max_body_bytes.saturating_mul(2))
            .max(raw.max_buffered_bytes_per_address.unwrap_or(0))
    });
    let max_buffered_bytes_per_address = raw
        .max_buffered_bytes_per_address
        .unwrap_or_else(|| (max_buffered_bytes / 2).max(max_body_bytes));
    if max_buffered_bytes_per_address < max_body_bytes {
        problem(
            "max_buffered_bytes_per_address",
            format!("`{max_buffered_bytes_per_address}` is less than server.max_body_bytes ({max_body_bytes}), so the largest body could never arrive: raise it, or leave it out"),
        );
    } else if max_buffered_bytes_per_address > max_buffered_bytes {
        problem(
            "max_buffered_bytes",
            format!("`{max_buffered_bytes}` is less than server.max_buffered_bytes_per_address ({max_buffered_bytes_per_address}): raise it, or leave it out"),
        );
    }
    ConnectionLimits {
        max_connections,
        max_connections_per_address,
        max_header_bytes,
        max_buffered_bytes,
        max_buffered_bytes_per_address,
        max_in_flight_per_key,
        ..defaults
    }
}

/// A configuration problem: the file, the field path and the fix.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
#[error("{file}: `{field}`: {fix}")]
pub struct ConfigError {
    pub file: String,
    pub field: String,
    pub fix: String,
}

/// Parses and validates a configuration; `file` names it in errors. `env` looks up
/// environment variables (secrets are referenced by name).
///
/// # Errors
/// The first problem found (see [`load_all`] for every problem).
pub fn load(
    text: &str,
    file: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<GatewayConfig, ConfigError> {
    load_all(text, file, env).map_err(|problems| {
        problems.into_iter().next().unwrap_or_else(|| ConfigError {
            file: file.to_owned(),
            field: "(config)".into(),
            fix: "invalid".into(),
        })
    })
}

/// `server.log_format`: `human` (the default) or `json`; anything else is a problem.
fn log_format(
    value: Option<&str>,
    err: &dyn Fn(&str, String) -> ConfigError,
    problems: &mut Vec<ConfigError>,
) -> LogFormat {
    match value {
        None | Some("human") => LogFormat::Human,
        Some("json") => LogFormat::Json,
        Some(_) => {
            let fix = "write \"human\" (the default) or \"json\"";
            problems.push(err("server.log_format", fix.into()));
            LogFormat::Human
        }
    }
}

/// An optional table checked by `check`; its problems, as (field, fix), go to `problems`.
fn validated<R, T>(
    raw: Option<R>,
    check: impl FnOnce(R) -> Result<T, Vec<(String, String)>>,
    err: &dyn Fn(&str, String) -> ConfigError,
    problems: &mut Vec<ConfigError>,
) -> Option<T> {
    match check(raw?) {
        Ok(t) => Some(t),
        Err(ps) => {
            problems.extend(ps.into_iter().map(|(field, fix)| err(&field, fix)));
            None
        }
    }
}

/// The gateway's keys and feedback rate, read from `server`'s key lists and tables (taken).
fn server_keys(
    server: &mut RawServer,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<keys::Validated, Vec<(String, String)>> {
    keys::validate(
        keys::RawKeys {
            api_keys_env: &server.api_keys_env,
            admin_keys_env: &server.admin_keys_env,
            keys: std::mem::take(&mut server.keys),
            feedback_rate_per_key: server.feedback_rate_per_key,
            feedback_burst_per_key: server.feedback_burst_per_key,
        },
        env,
    )
}

/// Like [`load`], but reports every problem it can find in one pass: every unknown field
/// (with the nearest known name), every value of the wrong type, then every server field,
/// interface and provider (a syntax error stops it, and so does a field that is missing or
/// of the wrong type and required: what follows could not be read as written).
///
/// # Errors
/// Every problem found: those of the file's shape in file order, then the others.
pub fn load_all(
    text: &str,
    file: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<GatewayConfig, Vec<ConfigError>> {
    let (raw, shape) = equiroute_toml::parse_all::<RawConfig>(text);
    let mut problems: Vec<ConfigError> = shape
        .iter()
        .map(|p| ConfigError {
            file: file.to_owned(),
            field: p.field.clone(),
            fix: gateway_policies(&unechoed(&p.field, &p.fix)),
        })
        .collect();
    let Some(raw) = raw else {
        return Err(problems);
    };
    match load_raw(raw, file, env) {
        Ok(cfg) if problems.is_empty() => Ok(cfg),
        Ok(_) => Err(problems),
        Err(more) => {
            // A member left out for its shape is not reported again as absent.
            let said = |field: &str| problems.iter().any(|p| field.starts_with(&p.field));
            let more: Vec<ConfigError> = more.into_iter().filter(|p| !said(&p.field)).collect();
            problems.extend(more);
            Err(problems)
        }
    }
}

/// The core's "unknown policy" message with only the policies the gateway accepts (`oracle`
/// is the laboratory's) and the nearest name; other messages as they are.
fn gateway_policies(fix: &str) -> String {
    let Some((head, _)) = fix.split_once(": valid policies are ") else {
        return fix.to_owned();
    };
    let place = fix.rfind(" (line ").map_or("", |i| &fix[i..]);
    let accepted: Vec<&str> = equiroute_core::policies::PolicyKind::ALL
        .iter()
        .map(|k| k.as_str())
        .filter(|k| *k != "oracle")
        .collect();
    let given = head.split('`').nth(1).unwrap_or_default();
    let hint = equiroute_toml::nearest(given, &accepted)
        .map_or(String::new(), |k| format!(" (did you mean `{k}`?)"));
    format!("{head}: write one of {}{hint}{place}", accepted.join(", "))
}

/// `server.listen` as an address: an IP address and port, or `localhost:PORT` (read as
/// 127.0.0.1:PORT); the fix otherwise.
fn listen_address(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    match text.rsplit_once(':') {
        Some(("localhost", port)) if port.parse::<u16>().is_ok() => format!("127.0.0.1:{port}")
            .parse()
            .map_err(|_| String::new()),
        Some((host, port)) if port.parse::<u16>().is_ok() && !host.is_empty() => Err(format!(
            "`{text}`: a host name is not allowed here, write an IP address and port, e.g. \
             127.0.0.1:{port} (this machine only) or 0.0.0.0:{port} (every interface)"
        )),
        _ => Err(format!(
            "`{text}` is not an address: write IP:port, e.g. 127.0.0.1:8080"
        )),
    }
}

/// [`load_all`]'s checks of a configuration read from its text.
fn load_raw(
    mut raw: RawConfig,
    file: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<GatewayConfig, Vec<ConfigError>> {
    let err = |field: &str, fix: String| ConfigError {
        file: file.to_owned(),
        field: field.to_owned(),
        fix,
    };
    let mut problems = Vec::new();
    let listen_text = raw.server.listen.as_deref().unwrap_or("127.0.0.1:8080");
    let listen = listen_address(listen_text)
        .map_err(|fix| problems.push(err("server.listen", fix)))
        .ok();
    let (keys, feedback_rate) = server_keys(&mut raw.server, env).unwrap_or_else(|ps| {
        problems.extend(ps.into_iter().map(|(field, fix)| err(&field, fix)));
        (Vec::new(), None)
    });
    let ttl = raw.server.feedback_ttl_s.unwrap_or(3600.0);
    if !(ttl.is_finite() && ttl > 0.0) {
        problems.push(err(
            "server.feedback_ttl_s",
            "must be a positive number of seconds".into(),
        ));
    }
    let max_pending_feedback = raw.server.max_pending_feedback.unwrap_or(32_768);
    if max_pending_feedback == 0 {
        problems.push(err(
            "server.max_pending_feedback",
            "must be at least 1 (default 32768)".into(),
        ));
    }
    let worker_threads = raw.server.worker_threads;
    if worker_threads == Some(0) {
        problems.push(err(
            "server.worker_threads",
            "must be at least 1 (leave it out for one thread per core)".into(),
        ));
    }
    let log_format = log_format(raw.server.log_format.as_deref(), &err, &mut problems);
    let max_body_bytes = raw.server.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
    let connections = connection_limits(&raw.server, max_body_bytes).unwrap_or_else(|ps| {
        problems.extend(ps.into_iter().map(|(field, fix)| err(&field, fix)));
        ConnectionLimits::default()
    });
    let shutdown_grace = shutdown_grace(&raw.server).unwrap_or_else(|(field, fix)| {
        problems.push(err(&field, fix));
        DEFAULT_SHUTDOWN_GRACE
    });
    if raw.interfaces.is_empty() {
        problems.push(err(
            "interfaces",
            "define at least one [interfaces.NAME] table".into(),
        ));
    }
    let state = validated(raw.state, |r| state::validate(r, env), &err, &mut problems);
    let telemetry = validated(raw.telemetry, telemetry::validate, &err, &mut problems);
    let mut warnings = Vec::new();
    let mut interfaces = Vec::new();
    for (name, raw_if) in raw.interfaces {
        match load_interface(&name, raw_if, env, &mut warnings) {
            Ok(i) => interfaces.push(i),
            Err(ps) => problems.extend(ps.into_iter().map(|(field, fix)| err(&field, fix))),
        }
    }
    match listen {
        Some(listen) if problems.is_empty() => Ok(GatewayConfig {
            listen,
            max_body_bytes,
            keys,
            feedback_rate,
            feedback_ttl: Millis(ttl * 1000.0),
            max_pending_feedback,
            worker_threads,
            log_format,
            connections,
            shutdown_grace,
            audit: raw.audit,
            state,
            telemetry,
            interfaces,
            warnings: warnings
                .into_iter()
                .map(|(field, why)| err(&field, why))
                .collect(),
        }),
        _ => Err(problems),
    }
}

/// An interface's `task_classes`: names as the trimmed header gives them, each once. The
/// error is the index at fault and the fix.
fn check_task_classes(classes: &[String]) -> Result<(), (usize, String)> {
    for (n, c) in classes.iter().enumerate() {
        if c.is_empty() || c.trim() != c {
            return Err((
                n,
                "must be a non-empty name without surrounding spaces (the header's value is trimmed)".into(),
            ));
        }
        if c.len() > MAX_TASK_CLASS_BYTES {
            return Err((
                n,
                format!(
                    "is {} bytes long: a task class header longer than {} bytes is treated as no class, so shorten the name",
                    c.len(),
                    MAX_TASK_CLASS_BYTES
                ),
            ));
        }
        if classes[..n].contains(c) {
            return Err((n, format!("`{c}` is listed twice")));
        }
    }
    Ok(())
}

/// Loads an interface's providers; every one is checked, so that one run reports every
/// broken provider.
fn load_providers(
    raw: Vec<RawProvider>,
    interface_params: Option<UnsupportedParams>,
    at: &dyn Fn(&str) -> String,
    env: &dyn Fn(&str) -> Option<String>,
    warnings: &mut Vec<(String, String)>,
) -> Result<Vec<ProviderConfig>, Vec<(String, String)>> {
    let mut providers = Vec::new();
    let mut problems = Vec::new();
    let mut ids: Vec<String> = Vec::new();
    for (n, p) in raw.into_iter().enumerate() {
        let field = |f: &str| at(&format!("providers[{n}].{f}"));
        if ids.contains(&p.id) {
            problems.push((
                field("id"),
                format!("`{}` is used twice: provider ids must be unique", p.id),
            ));
            continue;
        }
        ids.push(p.id.clone());
        warnings.extend(
            ignored_fields(&p)
                .into_iter()
                .map(|(f, why)| (field(f), why)),
        );
        let unsupported_params = p
            .unsupported_params
            .or(interface_params)
            .unwrap_or_default();
        match load_provider(p, env) {
            Ok(pc) => providers.push(ProviderConfig {
                unsupported_params,
                ..pc
            }),
            Err((f, fix)) => problems.push((field(f), fix)),
        }
    }
    if problems.is_empty() {
        Ok(providers)
    } else {
        Err(problems)
    }
}

/// One interface; errors carry the field path and the fix. Fields that are set but not read
/// go to `warnings`, with their path and why.
fn load_interface(
    name: &str,
    raw: RawInterface,
    env: &dyn Fn(&str) -> Option<String>,
    warnings: &mut Vec<(String, String)>,
) -> Result<InterfaceConfig, Vec<(String, String)>> {
    let at = |f: &str| format!("interfaces.{name}.{f}");
    if let Err(why) = check_name("interface names", name) {
        return Err(vec![(format!("interfaces.{name}"), why)]);
    }
    if raw.providers.is_empty() {
        return Err(vec![(
            at("providers"),
            "add at least one [[interfaces.NAME.providers]] entry".into(),
        )]);
    }
    let providers = load_providers(raw.providers, raw.unsupported_params, &at, env, warnings)?;
    let feature_dim = raw.feature_dim.unwrap_or(64);
    let feature_max_words = raw
        .feature_max_words
        .unwrap_or(equiroute_core::prelude::Featurizer::DEFAULT_MAX_WORDS);
    equiroute_core::prelude::Featurizer::check_max_words(feature_max_words)
        .map_err(|e| vec![(at("feature_max_words"), e.to_string())])?;
    let policies = (raw.policy.as_ref(), raw.shadow.as_ref(), raw.rollout);
    let (policy, rollout) =
        load_policies(policies, &providers, feature_dim).map_err(|(f, fix)| vec![(at(&f), fix)])?;
    let exploration_floor =
        exploration_floor(raw.min_propensity).map_err(|fix| vec![(at("min_propensity"), fix)])?;
    let positive = |v: Option<f64>, field: &str| -> Result<Option<Millis>, Vec<(String, String)>> {
        match v {
            Some(t) if t.is_finite() && t > 0.0 => Ok(Some(Millis(t))),
            Some(_) => Err(vec![(at(field), "must be a positive number of ms".into())]),
            None => Ok(None),
        }
    };
    let deadline = positive(raw.deadline_ms, "deadline_ms")?;
    let stream_idle = positive(raw.stream_idle_ms, "stream_idle_ms")?.unwrap_or(Millis(30_000.0));
    let limits = execution_limits(raw.max_attempts, raw.attempt_timeout_ms, raw.retry.as_ref())
        .map_err(|(f, fix)| vec![(at(&f), fix)])?;
    let first_byte = raw.first_byte.unwrap_or_default();
    first_byte
        .check()
        .map_err(|(f, fix)| vec![(at(&format!("first_byte.{f}")), fix)])?;
    let stream_hold = raw.stream_hold.unwrap_or_default();
    stream_hold
        .check()
        .map_err(|(f, fix)| vec![(at(&format!("stream_hold.{f}")), fix)])?;
    let stream_resume = raw.stream_resume.unwrap_or_default();
    stream_resume
        .check()
        .map_err(|(f, fix)| vec![(at(&format!("stream_resume.{f}")), fix)])?;
    let hedge =
        hedge_config(raw.hedge.as_ref(), raw.kind).map_err(|(f, fix)| vec![(at(&f), fix)])?;
    let breaker = raw.breaker.unwrap_or_default();
    breaker
        .validate()
        .map_err(|e| vec![(at("breaker"), e.to_string())])?;
    if let Some(classes) = &raw.task_classes {
        check_task_classes(classes)
            .map_err(|(n, why)| vec![(at(&format!("task_classes[{n}]")), why)])?;
    }
    let judge = match raw.judge {
        None => None,
        Some(j) => {
            Some(load_judge(j, env).map_err(|(f, fix)| vec![(at(&format!("judge.{f}")), fix)])?)
        }
    };
    Ok(InterfaceConfig {
        name: name.to_owned(),
        exploration_floor,
        stream_idle,
        first_byte,
        stream_hold,
        stream_resume,
        judge,
        kind: raw.kind,
        policy,
        deadline,
        limits,
        hedge,
        feature_dim,
        feature_max_words,
        breaker,
        task_classes: raw.task_classes,
        shadow: raw.shadow,
        rollout,
        providers,
    })
}

/// An interface's `min_propensity` as an exploration floor (inactive when absent), or the fix.
fn exploration_floor(
    min_propensity: Option<f64>,
) -> Result<equiroute_core::policies::ExplorationFloorConfig, String> {
    let floor = equiroute_core::policies::ExplorationFloorConfig {
        min_propensity: min_propensity.unwrap_or(0.0),
        ..equiroute_core::policies::ExplorationFloorConfig::default()
    };
    floor
        .validate()
        .map_err(|e| format!("{e} (e.g. 0.01: each provider first on at least 1% of requests)"))?;
    Ok(floor)
}

/// An interface's `policy` (`lqm-ts` by default), `shadow` and `rollout`: the policy built
/// against the providers, the shadow checked, the rollout validated; the error is (field under the interface, fix).
fn load_policies(
    (policy, shadow, rollout): (
        Option<&PolicyConfig>,
        Option<&PolicyConfig>,
        Option<rollout::RawRollout>,
    ),
    providers: &[ProviderConfig],
    feature_dim: usize,
) -> Result<(PolicyConfig, Option<RolloutConfig>), (String, String)> {
    let candidates: Vec<Candidate> = providers.iter().map(|p| p.candidate.clone()).collect();
    let candidates = &candidates[..];
    let policy = policy
        .cloned()
        .unwrap_or_else(|| PolicyConfig::default_for(equiroute_core::policies::PolicyKind::LqmTs));
    refuse_laboratory_policies(&policy).map_err(|fix| ("policy".to_owned(), fix))?;
    policy
        .build(candidates, feature_dim)
        .map_err(|e| ("policy".to_owned(), e.to_string()))?;
    let rollout = rollout::side_policies(shadow, rollout, candidates, feature_dim)?;
    Ok((policy, rollout))
}

/// The fields set on a provider that its kind does not read, each with why.
/// Policies that exist only in the laboratory are refused by the gateway, with the reason.
fn refuse_laboratory_policies(policy: &PolicyConfig) -> Result<(), String> {
    if policy.kind() == equiroute_core::policies::PolicyKind::Oracle {
        return Err(
            "`oracle` exists only in the laboratory (it reads the simulated world's \
                    true means, which a gateway cannot know): choose another policy, e.g. \
                    \"lqm-ts\""
                .into(),
        );
    }
    Ok(())
}

fn ignored_fields(p: &RawProvider) -> Vec<(&'static str, String)> {
    use ProviderKind::{Anthropic, AzureOpenai, Bedrock, Gemini, Http, Openai, Sim};
    let kind = p.kind.name();
    [
        ("sim", p.sim.is_some(), p.kind == Sim),
        (
            "base_url",
            p.base_url.is_some(),
            matches!(p.kind, Openai | Anthropic | Gemini | Bedrock),
        ),
        ("url", p.url.is_some(), p.kind == Http),
        (
            "api_key_env",
            p.api_key_env.is_some(),
            !matches!(p.kind, Sim | Bedrock),
        ),
        ("region", p.region.is_some(), p.kind == Bedrock),
        ("endpoint", p.endpoint.is_some(), p.kind == AzureOpenai),
        ("deployment", p.deployment.is_some(), p.kind == AzureOpenai),
        ("auth", p.auth.is_some(), p.kind == AzureOpenai),
        (
            "api_version",
            p.api_version.is_some(),
            matches!(p.kind, AzureOpenai | Anthropic),
        ),
        ("max_tokens", p.max_tokens.is_some(), p.kind == Anthropic),
        (
            "assistant_prefill",
            p.assistant_prefill.is_some(),
            p.kind != Http,
        ),
        // Only the native dialects have members they cannot express.
        (
            "unsupported_params",
            p.unsupported_params.is_some(),
            matches!(p.kind, Anthropic | Gemini | Bedrock),
        ),
    ]
    .into_iter()
    .filter(|&(_, set, read)| set && !read)
    .map(|(field, _, _)| {
        (
            field,
            format!("ignored: a `{kind}` provider does not read it (remove it, or change `kind`)"),
        )
    })
    .collect()
}

/// The longest interface name or provider id.
const MAX_NAME_LEN: usize = 64;

/// An interface name or provider id: it appears in URLs (`/v1/tools/NAME`), in `model`
/// (`interface/provider`), in headers and in metric labels, so it is 1–64 ASCII letters,
/// digits, `-`, `_`, `.` or `:`. The error says which character is wrong and a name that
/// would do.
fn check_name(what: &str, name: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
    if name.is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    if let Some(bad) = name.chars().find(|&c| !allowed(c)) {
        let fixed: String = name
            .chars()
            .map(|c| if allowed(c) { c } else { '_' })
            .collect();
        return Err(format!(
            "{what} are ASCII letters, digits, `-`, `_`, `.` and `:` (they appear in URLs, \
             model ids, headers and metric labels); {bad:?} is not one: rename it, e.g. `{fixed}`"
        ));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "{what} are at most {MAX_NAME_LEN} characters; this one has {}: shorten it",
            name.len()
        ));
    }
    Ok(())
}

/// One provider; errors carry the field below the provider and the fix.
fn load_provider(
    p: RawProvider,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ProviderConfig, (&'static str, String)> {
    check_name("provider ids", &p.id).map_err(|why| ("id", why))?;
    let upstream = match p.kind {
        ProviderKind::Sim => {
            let sim = p.sim.ok_or_else(|| {
                (
                    "sim",
                    "a `sim` provider needs sim = { latency = { p50_ms, p95_ms } }".to_owned(),
                )
            })?;
            if !(sim.latency.p50_ms > 0.0 && sim.latency.p95_ms >= sim.latency.p50_ms) {
                return Err(("sim.latency", "needs 0 < p50_ms ≤ p95_ms".into()));
            }
            if !(0.0..=1.0).contains(&sim.failure_rate)
                || !(0.0..=1.0).contains(&sim.rate_limit_rate)
            {
                return Err((
                    "sim",
                    "failure_rate and rate_limit_rate must be between 0 and 1".into(),
                ));
            }
            UpstreamConfig::Sim(sim)
        }
        ProviderKind::Openai => UpstreamConfig::Openai {
            base_url: http_url(
                p.base_url.as_deref(),
                "base_url",
                "https://api.openai.com/v1",
            )?
            .trim_end_matches('/')
            .to_owned(),
            api_key: secret(p.api_key_env.as_deref(), env)?,
        },
        ProviderKind::Http => UpstreamConfig::Http {
            url: http_url(
                p.url.as_deref(),
                "url",
                "https://search.example.com/v1/search",
            )?,
            api_key: secret(p.api_key_env.as_deref(), env)?,
        },
        ProviderKind::Anthropic
        | ProviderKind::AzureOpenai
        | ProviderKind::Gemini
        | ProviderKind::Bedrock => native_upstream(&p, env)?,
    };
    p.price.validate().map_err(|e| ("price", e.to_string()))?;
    let model = p.model.unwrap_or_else(|| p.id.clone());
    let mut candidate = Candidate::new(&p.id, &p.id, &model);
    candidate.id = CandidateId(p.id.clone());
    candidate.tier = p.tier;
    candidate.price = p.price;
    candidate.capabilities = p.capabilities.over(&p.kind.default_capabilities());
    if let Some((j, t)) = p
        .tenants
        .iter()
        .flatten()
        .enumerate()
        .find(|(_, t)| !keys::valid_tenant(t))
    {
        return Err((
            "tenants",
            format!(
                "`{t}` (entry {j}) is not a tenant name: {}",
                keys::TENANT_FIX
            ),
        ));
    }
    candidate.tenants = p.tenants;
    Ok(ProviderConfig {
        candidate,
        upstream,
        // Anthropic's Messages continues a final assistant turn; OpenAI's chat does not.
        assistant_prefill: p
            .assistant_prefill
            .unwrap_or(p.kind == ProviderKind::Anthropic),
        // Set by the interface's loading: the provider's own, else the interface's.
        unsupported_params: UnsupportedParams::default(),
    })
}

/// The upstream of a provider that speaks its host's own API (Anthropic, Azure, Gemini).
fn native_upstream(
    p: &RawProvider,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<UpstreamConfig, (&'static str, String)> {
    Ok(match p.kind {
        ProviderKind::Anthropic => UpstreamConfig::Anthropic {
            base_url: api_root(p.base_url.as_deref(), "https://api.anthropic.com/v1")?,
            api_key: secret(p.api_key_env.as_deref(), env)?,
            version: header_text(
                p.api_version.as_deref(),
                anthropic_defaults::DEFAULT_VERSION,
            )?,
            max_tokens: match p.max_tokens {
                Some(0) => {
                    return Err((
                        "max_tokens",
                        "must be at least 1 (leave it out for 4096)".into(),
                    ))
                }
                n => n.unwrap_or(anthropic_defaults::DEFAULT_MAX_TOKENS),
            },
        },
        ProviderKind::AzureOpenai => UpstreamConfig::AzureOpenai {
            endpoint: http_url(
                p.endpoint.as_deref(),
                "endpoint",
                "https://NAME.openai.azure.com",
            )?
            .trim_end_matches('/')
            .to_owned(),
            deployment: url_segment(
                "deployment",
                p.deployment
                    .as_deref()
                    .or(p.model.as_deref())
                    .unwrap_or(&p.id),
            )?,
            api_version: url_segment(
                "api_version",
                p.api_version
                    .as_deref()
                    .unwrap_or(AZURE_DEFAULT_API_VERSION),
            )?,
            api_key: secret(p.api_key_env.as_deref(), env)?,
            auth: p.auth.unwrap_or_default(),
        },
        ProviderKind::Gemini => {
            url_segment("model", p.model.as_deref().unwrap_or(&p.id))?;
            UpstreamConfig::Gemini {
                base_url: api_root(
                    p.base_url.as_deref(),
                    "https://generativelanguage.googleapis.com/v1beta",
                )?,
                api_key: secret(p.api_key_env.as_deref(), env)?,
            }
        }
        ProviderKind::Bedrock => bedrock_upstream(p, env)?,
        ProviderKind::Sim | ProviderKind::Openai | ProviderKind::Http => {
            return Err(("kind", "not a native dialect".into()))
        }
    })
}

/// A `bedrock` provider: its region, API root and the environment's AWS credentials.
fn bedrock_upstream(
    p: &RawProvider,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<UpstreamConfig, (&'static str, String)> {
    let model = p.model.as_deref().unwrap_or(&p.id);
    let model_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/');
    if model.is_empty() || !model.chars().all(model_ok) {
        return Err((
            "model",
            format!("`{model}` is not a Bedrock model id or ARN, e.g. anthropic.claude-sonnet-4-5-20250929-v1:0"),
        ));
    }
    let set = |name: &str| env(name).filter(|v| !v.is_empty());
    let region = match (
        p.region.as_deref(),
        set("AWS_REGION").or_else(|| set("AWS_DEFAULT_REGION")),
    ) {
        (Some(r), _) => r.to_owned(),
        (None, Some(r)) => r,
        (None, None) => {
            return Err((
                "region",
                "a `bedrock` provider needs a region: set `region = \"us-east-1\"` (or the \
                 environment variable AWS_REGION)"
                    .into(),
            ))
        }
    };
    if region.is_empty()
        || !region
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err((
            "region",
            format!("`{region}` is not an AWS region, e.g. us-east-1"),
        ));
    }
    let (Some(key_id), Some(secret_key)) = (set("AWS_ACCESS_KEY_ID"), set("AWS_SECRET_ACCESS_KEY"))
    else {
        return Err((
            "kind",
            "a `bedrock` provider signs with the environment's AWS credentials: export \
             AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary \
             credentials) before starting the gateway"
                .into(),
        ));
    };
    let default_url = format!("https://bedrock-runtime.{region}.amazonaws.com");
    Ok(UpstreamConfig::Bedrock {
        base_url: api_root(p.base_url.as_deref(), &default_url)?,
        credentials: AwsCredentials::new(&key_id, &secret_key, set("AWS_SESSION_TOKEN").as_deref()),
        region,
    })
}

fn load_judge(
    j: RawJudge,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<JudgeConfig, (&'static str, String)> {
    let sample_rate = j.sample_rate.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&sample_rate) {
        return Err(("sample_rate", "must be between 0 and 1".into()));
    }
    let prompt = j.prompt.unwrap_or_else(|| DEFAULT_JUDGE_PROMPT.to_owned());
    if !prompt.contains("{answer}") {
        return Err((
            "prompt",
            "must contain {answer} (and usually {question})".into(),
        ));
    }
    let timeout_ms = j.timeout_ms.unwrap_or(10_000.0);
    if !(timeout_ms.is_finite() && timeout_ms > 0.0) {
        return Err(("timeout_ms", "must be a positive number of ms".into()));
    }
    let max_in_flight = j.max_in_flight.unwrap_or(4);
    if max_in_flight == 0 {
        return Err(("max_in_flight", "must be at least 1".into()));
    }
    Ok(JudgeConfig {
        base_url: http_url(Some(&j.base_url), "base_url", "https://api.openai.com/v1")?
            .trim_end_matches('/')
            .to_owned(),
        model: j.model,
        api_key: secret(j.api_key_env.as_deref(), env)?,
        sample_rate,
        prompt,
        timeout_ms,
        max_in_flight,
    })
}

/// An API root: `url` (or the host's own, `default`) without a trailing `/`.
fn api_root(url: Option<&str>, default: &str) -> Result<String, (&'static str, String)> {
    Ok(http_url(Some(url.unwrap_or(default)), "base_url", default)?
        .trim_end_matches('/')
        .to_owned())
}

/// A name that goes into a URL's path or query as it is (a deployment, a model, a version).
fn url_segment(field: &'static str, value: &str) -> Result<String, (&'static str, String)> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@');
    if value.is_empty() || !value.chars().all(allowed) {
        return Err((
            field,
            format!("`{value}` cannot go into the provider's URL: use ASCII letters, digits, `-`, `_`, `.` and `@`"),
        ));
    }
    Ok(value.to_owned())
}

/// A value sent in a header as it is.
fn header_text(value: Option<&str>, default: &str) -> Result<String, (&'static str, String)> {
    let v = value.unwrap_or(default);
    if v.is_empty() || http::HeaderValue::from_str(v).is_err() {
        return Err((
            "api_version",
            format!("`{v}` cannot be sent as a header value, e.g. {default}"),
        ));
    }
    Ok(v.to_owned())
}

fn http_url(
    url: Option<&str>,
    field: &'static str,
    example: &str,
) -> Result<String, (&'static str, String)> {
    match url {
        Some(u)
            if (u.starts_with("http://") || u.starts_with("https://"))
                && u.parse::<http::Uri>().is_ok_and(|uri| uri.host().is_some()) =>
        {
            Ok(u.to_owned())
        }
        Some(u) => Err((
            field,
            format!("`{u}` is not an http(s) URL, e.g. {example}"),
        )),
        None => Err((
            field,
            format!("this provider kind needs `{field}`, e.g. {example}"),
        )),
    }
}

fn secret(
    name: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Secret>, (&'static str, String)> {
    let Some(n) = name else { return Ok(None) };
    let unset = "export it before starting the gateway";
    env_secret(n, "PROVIDER_API_KEY", unset, env)
        .map(Some)
        .map_err(|fix| ("api_key_env", fix))
}

/// The secret in the environment variable `name`, or what is wrong: `name` is no variable's
/// name (see [`not_a_variable_name`]; `example` is one for the field), or the variable is not
/// set (or empty), which `unset_fix` says how to mend.
pub(crate) fn env_secret(
    name: &str,
    example: &str,
    unset_fix: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Secret, String> {
    if let Some(fix) = not_a_variable_name(name, example) {
        return Err(fix);
    }
    match env(name) {
        Some(v) if !v.is_empty() => Ok(Secret(v)),
        _ => Err(format!(
            "environment variable `{name}` is not set: {unset_fix}"
        )),
    }
}

/// Why `name`, written in a field that names the environment variable holding a secret
/// (`api_key_env`, `api_keys_env`, `admin_keys_env`, `url_env`), is not such a name: it has a
/// credential's shape (`sk-…`, `AKIA…`, a URL with a password), is not a variable name at all
/// (letters, digits and `_`, not starting with a digit), or looks like a random token. A
/// secret pasted where its variable's name belongs is never repeated: the answer says what
/// it looks like and what to write instead, `example` being a variable name for the field.
fn not_a_variable_name(name: &str, example: &str) -> Option<String> {
    let is_name = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    // Variable names are words joined by `_`; keys are long runs of mixed letters and digits.
    let token_like = name.len() >= 20
        && !name.contains('_')
        && name.chars().any(|c| c.is_ascii_digit())
        && name.chars().any(|c| c.is_ascii_lowercase());
    let why = if crate::redact::looks_like_credential(name) {
        "it has the shape of a credential"
    } else if !is_name {
        "a variable name is letters, digits and `_`, not starting with a digit"
    } else if token_like {
        "it looks like a random token, not a name"
    } else {
        return None;
    };
    Some(format!(
        "this looks like a secret value, not the name of an environment variable ({why}); the \
         value is not shown. Put the secret in an environment variable (export \
         {example}=...) and write the variable's name here (\"{example}\"); if the value was \
         saved in a file or shared, rotate it"
    ))
}

/// A problem of reading the file, with no value of a field that names a secret's variable
/// (`api_key_env = ["sk-…"]` is read as "a sequence, not a string" by serde, whose message
/// quotes the value) and no credential-shaped text anywhere.
fn unechoed(field: &str, fix: &str) -> String {
    let names_a_variable = field
        .rsplit('.')
        .next()
        .is_some_and(|last| last.split('[').next().is_some_and(|f| f.ends_with("_env")));
    if names_a_variable {
        let place = fix.rfind(" (line ").map_or("", |i| &fix[i..]);
        return format!(
            "must name environment variables (a string for api_key_env and url_env, a list of \
             strings for api_keys_env and admin_keys_env), e.g. [\"GATEWAY_KEY\"]; the value \
             given is not shown{place}"
        );
    }
    crate::redact::Redactor::shapes_only()
        .redact(fix)
        .as_str()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn the_embedded_default_loads() {
        let cfg = load(DEFAULT_CONFIG, "default", &no_env).unwrap();
        assert!(cfg.interfaces.len() >= 2);
        assert!(cfg.listen.ip().is_loopback());
        assert_eq!(cfg.warnings, []);
    }

    #[test]
    fn min_propensity_wraps_the_policy_in_an_exploration_floor_and_a_bad_one_is_named() {
        let text = |floor: &str| {
            format!("[interfaces.chat]\nkind = \"chat\"\npolicy = \"lqm\"\n{floor}[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 10, p95_ms = 20 }} }}\n")
        };
        let off = load(&text(""), "x.toml", &no_env).unwrap();
        assert!(!off.interfaces[0].exploration_floor.is_active());
        let on = load(&text("min_propensity = 0.05\n"), "x.toml", &no_env).unwrap();
        assert!((on.interfaces[0].exploration_floor.min_propensity - 0.05).abs() < 1e-12);
        let e = load(&text("min_propensity = 0.7\n"), "x.toml", &no_env).unwrap_err();
        assert_eq!(e.field, "interfaces.chat.min_propensity");
        assert!(e.fix.contains("e.g. 0.01"), "{e}");
    }

    #[test]
    fn fields_a_provider_kind_does_not_read_are_warned_about() {
        let text = "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nbase_url = \"http://x/v1\"\napi_key_env = \"K\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n[[interfaces.chat.providers]]\nid = \"b\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\nurl = \"http://y\"\n";
        let cfg = load(text, "x.toml", &no_env).unwrap();
        let fields: Vec<&str> = cfg.warnings.iter().map(|w| w.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "interfaces.chat.providers[0].base_url",
                "interfaces.chat.providers[0].api_key_env",
                "interfaces.chat.providers[1].url",
            ]
        );
        assert!(cfg.warnings[0]
            .to_string()
            .contains("a `sim` provider does not read it"));
        assert_eq!(
            cfg.interfaces[0].providers.len(),
            2,
            "warnings never drop a provider"
        );
    }

    #[test]
    fn a_stream_hold_out_of_range_names_its_field_and_the_fix() {
        let base = "[interfaces.chat]\nkind = \"chat\"\nHOLD\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        let with = |hold: &str| load(&base.replace("HOLD", hold), "x.toml", &no_env);
        // By default only what precedes the first content is held (no timed hold).
        let default = with("").unwrap().interfaces[0].stream_hold;
        assert!(default.is_on() && default.until_content && !default.is_timed());
        let off = with("stream_hold = { until_content = false }").unwrap();
        assert!(!off.interfaces[0].stream_hold.is_on());
        let on = with("stream_hold = { ms = 800, events = 20 }").unwrap();
        assert_eq!(
            on.interfaces[0].stream_hold,
            first_byte::StreamHold {
                ms: 800.0,
                events: 20,
                until_content: true
            }
        );
        for (hold, field) in [
            (
                "stream_hold = { ms = -1 }",
                "interfaces.chat.stream_hold.ms",
            ),
            (
                "stream_hold = { ms = 60001 }",
                "interfaces.chat.stream_hold.ms",
            ),
            (
                "stream_hold = { events = 100001 }",
                "interfaces.chat.stream_hold.events",
            ),
        ] {
            let e = with(hold).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains("must be"), "{hold}: {e}");
        }
    }

    #[test]
    fn unsupported_params_is_drop_by_default_the_providers_own_wins_and_others_are_warned() {
        let text = |iface: &str| {
            format!(
                "[interfaces.chat]\nkind = \"chat\"\n{iface}\n\
                 [[interfaces.chat.providers]]\nid = \"g\"\nkind = \"gemini\"\n\
                 [[interfaces.chat.providers]]\nid = \"c\"\nkind = \"anthropic\"\nunsupported_params = \"drop\"\n\
                 [[interfaces.chat.providers]]\nid = \"o\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\nunsupported_params = \"reject\"\n"
            )
        };
        let policies = |iface: &str| -> Vec<UnsupportedParams> {
            let cfg = load_all(&text(iface), "x.toml", &no_env).unwrap();
            cfg.interfaces[0]
                .providers
                .iter()
                .map(|p| p.unsupported_params)
                .collect()
        };
        let (drop, reject) = (UnsupportedParams::Drop, UnsupportedParams::Reject);
        assert_eq!(policies(""), [drop, drop, reject]);
        assert_eq!(
            policies("unsupported_params = \"reject\""),
            [reject, drop, reject]
        );
        // An OpenAI-compatible API takes every member: the setting is not read there.
        let cfg = load_all(&text(""), "x.toml", &no_env).unwrap();
        let fields: Vec<&str> = cfg.warnings.iter().map(|w| w.field.as_str()).collect();
        assert_eq!(fields, ["interfaces.chat.providers[2].unsupported_params"]);
        let e = load(&text("unsupported_params = \"ignore\""), "x.toml", &no_env)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unsupported_params") && e.contains("drop"),
            "{e}"
        );
    }

    #[test]
    fn localhost_is_read_as_loopback_and_an_unknown_policy_lists_only_the_gateways() {
        let base = "[server]\nlisten = \"LISTEN\"\n[interfaces.chat]\nkind = \"chat\"\npolicy = \"POLICY\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        let with = |listen: &str, policy: &str| {
            load(
                &base.replace("LISTEN", listen).replace("POLICY", policy),
                "x.toml",
                &no_env,
            )
        };
        let cfg = with("localhost:9090", "lqm").unwrap();
        assert_eq!(cfg.listen.to_string(), "127.0.0.1:9090");
        let e = with("gateway.local:9090", "lqm").unwrap_err();
        assert_eq!(e.field, "server.listen");
        assert!(e.fix.contains("e.g. 127.0.0.1:9090"), "{e}");
        let e = with("127.0.0.1:9090", "lqm-tss").unwrap_err();
        assert!(e.fix.contains("(did you mean `lqm-ts`?)"), "{e}");
        assert!(
            e.fix.contains("cheapest") && !e.fix.contains("oracle"),
            "{e}"
        );
    }

    #[test]
    fn stream_resume_is_prefix_by_default_and_its_fields_are_checked_by_name() {
        let base = "[interfaces.chat]\nkind = \"chat\"\nRESUME\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\n[[interfaces.chat.providers]]\nid = \"b\"\nkind = \"anthropic\"\n[[interfaces.chat.providers]]\nid = \"c\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\nassistant_prefill = true\n";
        let with = |r: &str| load(&base.replace("RESUME", r), "x.toml", &no_env);
        let off = with("").unwrap();
        assert_eq!(
            off.interfaces[0].stream_resume.mode,
            first_byte::ResumeMode::Prefix,
            "prefix by default"
        );
        assert!(!with("stream_resume = { mode = \"off\" }")
            .unwrap()
            .interfaces[0]
            .stream_resume
            .is_on());
        // Prefill: Anthropic's by default, anyone's when declared.
        let prefill: Vec<bool> = off.interfaces[0]
            .providers
            .iter()
            .map(|p| p.assistant_prefill)
            .collect();
        assert_eq!(prefill, [false, true, true]);
        let on = with("stream_resume = { mode = \"prefix\", max = 2 }").unwrap();
        assert_eq!(
            on.interfaces[0].stream_resume,
            first_byte::StreamResume {
                mode: first_byte::ResumeMode::Prefix,
                max: 2,
                max_kept_bytes: 64 * 1024
            }
        );
        for (resume, field, fix) in [
            (
                "stream_resume = { mode = \"prefix\", max = 0 }",
                "interfaces.chat.stream_resume.max",
                "must be from 1",
            ),
            (
                "stream_resume = { mode = \"restart\", max_kept_bytes = 0 }",
                "interfaces.chat.stream_resume.max_kept_bytes",
                "must be from 1",
            ),
            (
                "stream_resume = { mode = \"continue\" }",
                "interfaces.chat.stream_resume.mode",
                "unknown variant",
            ),
        ] {
            let e = with(resume).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(fix), "{resume}: {e}");
        }
    }

    #[test]
    fn a_policy_is_a_name_or_a_table_and_oracle_is_refused() {
        let base = "[interfaces.chat]\nkind = \"chat\"\nPOLICY\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        let with = |policy: &str| load(&base.replace("POLICY", policy), "x.toml", &no_env);
        // The name alone is the policy with its defaults, as the table with only a name.
        let by_name = with("policy = \"lqm\"").map(|c| c.interfaces[0].policy.clone());
        let by_table = with("policy = { name = \"lqm\" }").map(|c| c.interfaces[0].policy.clone());
        assert_eq!(by_name, by_table);
        assert_eq!(
            by_name.map(|p| p.kind()),
            Ok(equiroute_core::policies::PolicyKind::Lqm)
        );
        // Errors name the policy field and the valid shapes, never serde's internal names.
        for (policy, says) in [
            ("policy = \"lqmx\"", "lqm-ts"),
            ("policy = 3", "a name such as"),
            ("policy = { l_ref_ms = 800 }", "has no `name`"),
            ("policy = { name = \"lqm\", l_ref = 800 }", "l_ref"),
            ("policy = \"oracle\"", "only in the laboratory"),
            ("policy = { name = \"oracle\" }", "only in the laboratory"),
        ] {
            let e = with(policy).unwrap_err();
            let text = e.to_string();
            assert!(
                e.field.starts_with("interfaces.chat.policy"),
                "{policy}: {e}"
            );
            assert!(text.contains(says), "{policy}: {e}");
            assert!(
                !text.contains("PolicyConfig") && !text.contains("internally tagged"),
                "{policy}: {e}"
            );
        }
    }

    #[test]
    fn problems_name_the_field_and_the_fix() {
        let base = "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        assert!(load(base, "x.toml", &no_env).is_ok());
        let two = load(
            &format!("[server]\nworker_threads = 2\n{base}"),
            "x.toml",
            &no_env,
        );
        assert_eq!(two.map(|c| c.worker_threads), Ok(Some(2)));
        let json = load(
            &format!("[server]\nlog_format = \"json\"\n{base}"),
            "x.toml",
            &no_env,
        );
        assert_eq!(json.map(|c| c.log_format), Ok(LogFormat::Json));
        let grace = |extra: &str| {
            load(&format!("[server]\n{extra}\n{base}"), "x.toml", &no_env).map(|c| c.shutdown_grace)
        };
        assert_eq!(grace(""), Ok(Duration::from_secs(20)));
        assert_eq!(
            grace("shutdown_grace_ms = 1500"),
            Ok(Duration::from_millis(1500))
        );
        let words = load(
            &base.replace(
                "kind = \"chat\"",
                "kind = \"chat\"\nfeature_max_words = 300",
            ),
            "x.toml",
            &no_env,
        );
        assert_eq!(words.map(|c| c.interfaces[0].feature_max_words), Ok(300));
        let cases = [
            (base.replace("p95_ms = 20", "p95_ms = 5"), "interfaces.chat.providers[0].sim.latency", "p50_ms"),
            (format!("{base}[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 10, p95_ms = 20 }} }}\n"), "interfaces.chat.providers[1].id", "unique"),
            (base.replace("kind = \"chat\"", "kind = \"chat\"\npolicy = { name = \"lqm\", alpha_ucb = -1 }"), "interfaces.chat.policy", "alpha_ucb"),
            (format!("[server]\napi_keys_env = [\"NOPE_KEY\"]\n{base}"), "server.api_keys_env[0]", "NOPE_KEY"),
            (base.replace("kind = \"chat\"", "kind = \"chat\"\ndeadline_ms = -5"), "interfaces.chat.deadline_ms", "positive"),
            (format!("[server]\nworker_threads = 0\n{base}"), "server.worker_threads", "at least 1"),
            (format!("[server]\nlog_format = \"yaml\"\n{base}"), "server.log_format", "\"json\""),
            (format!("[server]\nshutdown_grace_ms = -1\n{base}"), "server.shutdown_grace_ms", "default 20000"),
            (base.replace("kind = \"chat\"", "kind = \"chat\"\nfeature_max_words = 10"), "interfaces.chat.feature_max_words", "between 64 and 1000000"),
            (base.replace("kind = \"chat\"", "kind = \"chat\"\nbreaker = { consecutive_failures = 0 }"), "interfaces.chat.breaker", "breaker.consecutive_failures"),
            (base.replace("kind = \"chat\"", "kind = \"chat\"\nbreaker = { window = 10, min_attempts = 20 }"), "interfaces.chat.breaker", "must not exceed breaker.window"),
            (base.replace("kind = \"sim\"", "kind = \"sim\"\nprice = { per_million_input_tokens = -1 }"), "interfaces.chat.providers[0].price", "per_million_input_tokens"),
            (base.replace("kind = \"chat\"", "kind = \"chat\"\ntask_classes = [\"code\", \" code\"]"), "interfaces.chat.task_classes[1]", "surrounding spaces"),
            (base.replace("kind = \"chat\"", "kind = \"chat\"\ntask_classes = [\"code\", \"code\"]"), "interfaces.chat.task_classes[1]", "listed twice"),
            (base.replace("kind = \"chat\"", &format!("kind = \"chat\"\ntask_classes = [\"{}\"]", "c".repeat(65))), "interfaces.chat.task_classes[0]", "65 bytes long"),
            (base.replace("kind = \"chat\"", "kind = \"chat\"\npolicy = { name = \"ts-deadline\", risk = { max_slices = 0 } }"), "interfaces.chat.policy", "max_slices"),
            (base.replace("kind = \"chat\"", "kind = \"chat\"\npolicy = { name = \"lqm-ts\", risk = { max_slice_bytes = 1000 } }"), "interfaces.chat.policy", "max_slice_bytes"),
        ];
        for (text, field, fix) in cases {
            let e = load(&text, "x.toml", &no_env).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(
                e.to_string().contains(fix) && e.to_string().starts_with("x.toml"),
                "{e}"
            );
        }
        let e = load(
            &base.replace("kind = \"sim\"", "kind = \"sim\"\nweight = 3"),
            "x.toml",
            &no_env,
        )
        .unwrap_err();
        assert!(e.fix.contains("weight"), "{e}");
        // A partial breaker table keeps the other thresholds' defaults; a misspelt one is
        // refused with the valid names.
        let breaker = load(
            &base.replace(
                "kind = \"chat\"",
                "kind = \"chat\"\nbreaker = { consecutive_failures = 2, open_ms = 5000 }",
            ),
            "x.toml",
            &no_env,
        )
        .map(|c| c.interfaces[0].breaker);
        assert_eq!(
            breaker,
            Ok(BreakerConfig {
                consecutive_failures: 2,
                open_ms: 5000.0,
                ..BreakerConfig::default()
            })
        );
        let e = load(
            &base.replace(
                "kind = \"chat\"",
                "kind = \"chat\"\nbreaker = { failures = 2 }",
            ),
            "x.toml",
            &no_env,
        )
        .unwrap_err();
        assert_eq!(e.field, "interfaces.chat.breaker.failures", "{e}");
        assert!(
            e.fix.contains("consecutive_failures") && e.fix.ends_with("(line 3, column 13)"),
            "{e}"
        );
    }

    /// Names go into URLs, `model`, headers and metric labels: a space, a `/`, a
    /// non-ASCII letter or an over-long name is refused with a name that would do.
    #[test]
    fn interface_names_and_provider_ids_are_url_safe() {
        let config = |iface: &str, id: &str| {
            format!("[interfaces.{iface}]\nkind = \"chat\"\n[[interfaces.{iface}.providers]]\nid = \"{id}\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 10, p95_ms = 20 }} }}\n")
        };
        for (iface, id) in [("chat", "gpt-4o.mini:flex_2"), ("web_search", "A.b-c:d_9")] {
            let cfg = load(&config(iface, id), "x.toml", &no_env);
            assert!(cfg.is_ok(), "{iface}/{id}: {:?}", cfg.err());
        }
        let long = "a".repeat(MAX_NAME_LEN + 1);
        let cases = [
            (
                config("\"web search\"", "a"),
                "interfaces.web search",
                "e.g. `web_search`",
            ),
            (
                config("chat", "team/a"),
                "interfaces.chat.providers[0].id",
                "'/' is not one: rename it, e.g. `team_a`",
            ),
            (
                config("chat", "café"),
                "interfaces.chat.providers[0].id",
                "e.g. `caf_`",
            ),
            (
                config("chat", ""),
                "interfaces.chat.providers[0].id",
                "must not be empty",
            ),
            (
                config(&long, "a"),
                &format!("interfaces.{long}"),
                "at most 64 characters; this one has 65",
            ),
        ];
        for (text, field, fix) in &cases {
            let e = load(text, "x.toml", &no_env).unwrap_err();
            assert_eq!(&e.field, field, "{e}");
            assert!(e.fix.contains(fix), "{e}");
        }
    }

    #[test]
    fn parse_errors_name_the_path_the_line_and_the_column() {
        let base = "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        let cases = [
            (
                base.replace("kind = \"sim\"", "kind = \"sim\"\nweight = 3"),
                "interfaces.chat.providers[0].weight",
                "unknown field `weight`",
                "(line 6, column 1)",
            ),
            (
                base.replace("p50_ms = 10", "p50_ms = \"ten\""),
                "interfaces.chat.providers[0].sim.latency.p50_ms",
                "expected a number, e.g. `p50_ms = 1.5`, got a string",
                "(line 6, column 30)",
            ),
            (
                base.replace("\"chat\"", "\"chatt\""),
                "interfaces.chat.kind",
                "write one of `chat`, `tool` (did you mean `chat`?)",
                "(line 2, column 8)",
            ),
            (
                format!("[sever]\n{base}"),
                "sever",
                "did you mean `server`?",
                "(line 1, column 2)",
            ),
            (
                base.replace("\"chat\"", "chat"),
                "(syntax)",
                "string values must be quoted",
                "(line 2, column 8)",
            ),
        ];
        for (text, field, what, place) in cases {
            let e = load(&text, "x.toml", &no_env).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.fix.contains(what) && e.fix.ends_with(place), "{e}");
        }
    }

    #[test]
    fn every_problem_is_reported_in_one_pass() {
        let text = "[server]\nlisten = \"nope\"\n[interfaces.a]\nkind = \"chat\"\n[[interfaces.a.providers]]\nid = \"x\"\nkind = \"sim\"\n[[interfaces.a.providers]]\nid = \"y\"\nkind = \"openai\"\n[interfaces.b]\nkind = \"tool\"\n";
        let problems = load_all(text, "x.toml", &no_env).unwrap_err();
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            vec![
                "server.listen",
                "interfaces.a.providers[0].sim",
                "interfaces.a.providers[1].base_url",
                "interfaces.b.providers"
            ]
        );
    }

    #[test]
    fn secrets_come_from_the_environment_and_are_not_in_errors() {
        let text = "[server]\napi_keys_env = [\"GW_KEY\"]\n[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        let env = |name: &str| (name == "GW_KEY").then(|| "s3cret-value".to_owned());
        let cfg = load(text, "x.toml", &env).unwrap();
        assert_eq!(cfg.keys.len(), 1);
        assert_eq!(cfg.keys[0].secret, Secret("s3cret-value".to_owned()));
        assert_eq!(
            &*cfg.keys[0].grant.label, "GW_KEY",
            "labelled by the variable's name"
        );
        assert_eq!(cfg.keys[0].grant.role, KeyRole::Client);
        assert!(
            !format!("{cfg:?}").contains("s3cret"),
            "Debug redacts secrets"
        );
        assert!(
            !format!("{:?}", load("[server]\nlisten = \"nope\"", "x.toml", &env))
                .contains("s3cret")
        );
    }

    #[test]
    fn a_secret_pasted_where_its_variable_name_belongs_is_never_repeated() {
        let provider = |kind: &str, extra: &str| {
            format!("[[interfaces.chat.providers]]\nid = \"{kind}\"\nkind = \"{kind}\"\nbase_url = \"http://x/v1\"\n{extra}\n")
        };
        let pasted = [
            "sk-proj-AbCdEf0123456789xyz",
            "AKIAIOSFODNN7EXAMPLE",
            "a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6",
            "redis://:hunter2-pw@10.0.0.1:6379",
            "3f9a-key with spaces",
        ];
        let text = format!(
            "[server]\napi_keys_env = [\"{}\"]\nadmin_keys_env = [\"OK_NAME\", \"{}\"]\n\
             [state]\nbackend = \"redis\"\nurl_env = \"{}\"\n\
             [interfaces.judged]\nkind = \"chat\"\n\
             judge = {{ base_url = \"http://j/v1\", model = \"m\", api_key_env = \"{}\" }}\n\
             [[interfaces.judged.providers]]\nid = \"s\"\nkind = \"sim\"\n\
             sim = {{ latency = {{ p50_ms = 10, p95_ms = 20 }} }}\n\
             [interfaces.chat]\nkind = \"chat\"\n{}{}",
            pasted[0],
            pasted[2],
            pasted[3],
            pasted[4],
            provider("openai", &format!("api_key_env = \"{}\"", pasted[1])),
            provider("anthropic", "api_key_env = \"UNSET_NAME\""),
        );
        let env = |name: &str| (name == "OK_NAME").then(|| "fine".to_owned());
        let problems = load_all(&text, "x.toml", &env).unwrap_err();
        let shown: Vec<(String, String)> = problems
            .iter()
            .map(|p| (p.field.clone(), p.to_string()))
            .collect();
        for value in pasted {
            assert!(
                shown.iter().all(|(_, text)| !text.contains(value)),
                "{value} is repeated: {shown:#?}"
            );
        }
        let looks = |field: &str| {
            shown.iter().any(|(f, text)| {
                f == field
                    && text.contains(
                        "looks like a secret value, not the name of an environment variable",
                    )
                    && text.contains("rotate it")
            })
        };
        for field in [
            "server.api_keys_env[0]",
            "server.admin_keys_env[1]",
            "state.url_env",
            "interfaces.judged.judge.api_key_env",
            "interfaces.chat.providers[0].api_key_env",
        ] {
            assert!(looks(field), "{field}: {shown:#?}");
        }
        // A real variable's name that is not set is named, as before.
        assert!(
            shown
                .iter()
                .any(|(f, text)| f == "interfaces.chat.providers[1].api_key_env"
                    && text.contains("environment variable `UNSET_NAME` is not set")),
            "{shown:#?}"
        );
        // A key pasted as the list's text, not in a list: serde's message would quote it.
        let e = load(
            "[server]\napi_keys_env = \"sk-proj-AbCdEf0123456789xyz\"\n",
            "x.toml",
            &env,
        )
        .unwrap_err();
        assert_eq!(e.field, "server.api_keys_env");
        assert!(
            !e.to_string().contains("AbCdEf0123456789") && e.fix.contains("is not shown"),
            "{e}"
        );
    }

    #[test]
    fn every_secret_of_the_configuration_is_given_to_the_redactor() {
        let text = "[server]\napi_keys_env = [\"GW\"]\nadmin_keys_env = [\"ADMIN\"]\n\
            [state]\nbackend = \"redis\"\nurl_env = \"REDIS_URL\"\n\
            [interfaces.chat]\nkind = \"chat\"\n\
            judge = { base_url = \"http://j/v1\", model = \"m\", api_key_env = \"JUDGE\" }\n\
            [[interfaces.chat.providers]]\nid = \"o\"\nkind = \"openai\"\nbase_url = \"http://x/v1\"\napi_key_env = \"OA\"\n\
            [[interfaces.chat.providers]]\nid = \"b\"\nkind = \"bedrock\"\nregion = \"us-east-1\"\nmodel = \"m\"\n";
        let values = [
            ("GW", "gw-value"),
            ("ADMIN", "admin-value"),
            ("REDIS_URL", "redis://:redis-pw@h:6379"),
            ("JUDGE", "judge-value"),
            ("OA", "openai-value"),
            ("AWS_ACCESS_KEY_ID", "key-id-value"),
            ("AWS_SECRET_ACCESS_KEY", "secret-key-value"),
            ("AWS_SESSION_TOKEN", "session-value"),
        ];
        let env = |name: &str| {
            values
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        };
        let cfg = load(text, "x.toml", &env).unwrap();
        let secrets = cfg.secret_values();
        for (_, value) in values {
            assert!(secrets.contains(&value), "{value}: {secrets:?}");
        }
        assert!(secrets.contains(&"redis-pw"), "{secrets:?}");
    }
}
