//! The validated configuration, what `load` returns: the gateway, its
//! interfaces and providers, how each upstream is reached, the connection limits and the audit
//! log.

use super::defaults::{DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_HEADER_BYTES};
use super::first_byte;
use super::keys::{FeedbackRate, KeyConfig};
use super::problems::ConfigError;
use super::rollout::RolloutConfig;
use super::secrets::{AwsCredentials, Secret};
use super::state::{self, StateConfig};
use super::telemetry::TelemetryConfig;
use super::tls::TlsConfig;
use equiroute_core::breaker::BreakerConfig;
use equiroute_core::executor::ExecutionLimits;
use equiroute_core::latency::LatencySpec;
use equiroute_core::policies::PolicyConfig;
use equiroute_core::{Candidate, Capabilities, Millis};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::time::Duration;

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
    /// The capacity the operator declares for the provider's key (`rpm`, `tpm`,
    /// `max_concurrency`): never exceeded by this gateway (see `server::capacity`).
    pub caps: Caps,
}

/// A provider's declared capacity: requests and tokens in any 60 s, requests in flight.
/// `None`: no such cap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    pub rpm: Option<u64>,
    pub tpm: Option<u64>,
    pub max_concurrency: Option<u64>,
}

impl Caps {
    /// Whether any cap is declared.
    #[must_use]
    pub fn any(&self) -> bool {
        self.rpm.is_some() || self.tpm.is_some() || self.max_concurrency.is_some()
    }
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

/// One interface, validated: at least one provider, a built-and-checked policy.
#[derive(Clone, Debug, PartialEq)]
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
    /// HTTPS on `listen` (`[server.tls]`); none: plain HTTP.
    pub tls: Option<TlsConfig>,
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
            out.extend(r.password.as_ref().map(|p| p.0.as_str()));
        }
        out
    }
}

impl GatewayConfig {
    /// The settings that differ between this configuration and `next` and that a running
    /// gateway cannot change (its sockets, threads, keys, limits, logs and state backend are
    /// set up once, at start): a reload to `next` is refused while this list is not empty.
    /// Everything under `[interfaces]` can change.
    #[must_use]
    pub fn restart_needed(&self, next: &GatewayConfig) -> Vec<&'static str> {
        let (a, b) = (self, next);
        [
            ("server.listen", a.listen == b.listen),
            ("server.max_body_bytes", a.max_body_bytes == b.max_body_bytes),
            (
                "the keys (server.api_keys_env, server.admin_keys_env, [[server.keys]])",
                a.keys == b.keys,
            ),
            (
                "server.feedback_rate_per_key and feedback_burst_per_key",
                a.feedback_rate == b.feedback_rate,
            ),
            ("server.feedback_ttl_s", a.feedback_ttl == b.feedback_ttl),
            (
                "server.max_pending_feedback",
                a.max_pending_feedback == b.max_pending_feedback,
            ),
            ("server.worker_threads", a.worker_threads == b.worker_threads),
            ("server.log_format", a.log_format == b.log_format),
            (
                "the connection limits (server.*_timeout_ms, max_connections*, max_header_bytes, max_buffered_bytes*, max_in_flight_per_key)",
                a.connections == b.connections,
            ),
            ("server.shutdown_grace_ms", a.shutdown_grace == b.shutdown_grace),
            ("[audit]", a.audit == b.audit),
            ("[state]", a.state == b.state),
            ("[telemetry]", a.telemetry == b.telemetry),
        ]
        .into_iter()
        .filter(|(_, same)| !same)
        .map(|(what, _)| what)
        .collect()
    }
}

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

#[cfg(test)]
mod tests {
    use crate::config::load;

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

    #[test]
    fn a_reload_needs_a_restart_for_what_is_set_up_at_start_only() {
        let iface = "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 1, p95_ms = 2 } }\n";
        let cfg = |text: &str| load(text, "x.toml", &crate::config::no_env).unwrap();
        let running = cfg(iface);
        // Interfaces may change.
        let priced = format!("{iface}price = {{ per_call = 0.01 }}\n");
        assert!(running.restart_needed(&cfg(&priced)).is_empty());
        let next = cfg(&format!(
            "[server]\nlisten = \"127.0.0.1:9\"\nshutdown_grace_ms = 5\n[audit]\npath = \"a.log\"\n{iface}"
        ));
        assert_eq!(
            running.restart_needed(&next),
            ["server.listen", "server.shutdown_grace_ms", "[audit]"]
        );
    }
}
