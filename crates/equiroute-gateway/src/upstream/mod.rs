//! Upstream providers, one file per kind. A closed set: an enum, matched exhaustively.

pub mod answer;
pub mod anthropic;
pub mod bedrock;
pub mod body;
pub mod client;
pub mod dialect;
pub use equiroute_eventstream as eventstream;
pub mod gemini;
pub mod http;
pub mod limits;
pub mod sim;

use crate::config::{InterfaceKind, UpstreamConfig};
use crate::redact::{Redacted, Redactor};
pub use body::ClientBody;
use bytes::Bytes;
use equiroute_core::{AttemptStatus, Millis};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// The rest of a streamed answer, chunk by chunk; `Err` means the stream broke.
pub type ChunkStream = Pin<Box<dyn futures_util::Stream<Item = Result<Bytes, String>> + Send>>;

/// How a streamed attempt began.
pub enum StreamStart {
    /// The first bytes arrived within the limit: relay `first`, then `rest`.
    Started {
        first: Bytes,
        rest: ChunkStream,
        ttfb: Millis,
        /// What the provider's rate-limit headers said is left of its capacity.
        capacity: limits::Capacity,
    },
    /// The attempt ended before its first byte (error, timeout, connection failure).
    Failed(UpstreamReply),
}

/// What the gateway forwards to a provider.
#[derive(Clone, Copy, Debug)]
pub struct UpstreamRequest<'a> {
    pub kind: InterfaceKind,
    /// The client's JSON body, parsed and as it came.
    pub body: &'a ClientBody,
    /// The provider's model name.
    pub model: &'a str,
    /// Seeds the simulated provider's randomness for this attempt.
    pub seed: u64,
}

/// What came back from one attempt.
#[derive(Clone, Debug)]
pub struct UpstreamReply {
    pub status: AttemptStatus,
    pub latency: Millis,
    /// The provider's JSON body on success.
    pub body: Option<answer::ProviderJson>,
    /// The provider's HTTP status (0 when no response arrived).
    pub http_status: u16,
    pub retry_after: Option<Millis>,
    /// What the provider's rate-limit headers said is left of its capacity.
    pub capacity: limits::Capacity,
    /// A short reason for failures: the provider's words passed through the gateway's
    /// [`Redactor`](crate::redact::Redactor), or the gateway's own.
    pub reason: Option<Redacted>,
    /// The provider refused the request as too long for its context window.
    pub context_overflow: bool,
    /// The provider's content filter refused the request (`error.code = "content_filter"`).
    pub content_filter: bool,
}

impl UpstreamReply {
    /// An attempt that ended without an answer: `status` with its redacted reason.
    #[must_use]
    pub fn failed(
        status: AttemptStatus,
        latency: Millis,
        http_status: u16,
        reason: Redacted,
    ) -> UpstreamReply {
        UpstreamReply {
            status,
            latency,
            body: None,
            http_status,
            retry_after: None,
            capacity: limits::Capacity::default(),
            reason: Some(reason),
            context_overflow: false,
            content_filter: false,
        }
    }
}

/// A configured upstream.
#[derive(Clone, Debug)]
pub enum Upstream {
    Sim(sim::SimUpstream),
    Http(http::HttpUpstream),
}

impl Upstream {
    /// The provider's name in OpenTelemetry's `gen_ai.provider.name`.
    #[must_use]
    pub fn system(&self) -> &'static str {
        match self {
            Upstream::Sim(_) => "equiroute.sim",
            Upstream::Http(h) => h.system(),
        }
    }

    /// The upstream described by `config`; HTTP upstreams share `client`'s connection pool
    /// and pass every text of the provider's through `redactor`.
    #[must_use]
    pub fn new(
        id: &str,
        tier: equiroute_core::ServiceTier,
        config: &UpstreamConfig,
        client: &client::HttpClient,
        redactor: &Arc<Redactor>,
    ) -> Upstream {
        let wiring = http::Wiring {
            client: client.clone(),
            redactor: redactor.clone(),
        };
        match config {
            UpstreamConfig::Sim(spec) => Upstream::Sim(sim::SimUpstream::new(id, *spec)),
            UpstreamConfig::Openai { base_url, api_key } => Upstream::Http(
                http::HttpUpstream::openai(wiring.clone(), base_url, api_key.as_ref(), tier),
            ),
            UpstreamConfig::Http { url, api_key } => Upstream::Http(http::HttpUpstream::json(
                wiring.clone(),
                url,
                api_key.as_ref(),
            )),
            UpstreamConfig::Anthropic {
                base_url,
                api_key,
                version,
                max_tokens,
            } => Upstream::Http(http::HttpUpstream::anthropic(
                wiring.clone(),
                base_url,
                api_key.as_ref(),
                version,
                *max_tokens,
            )),
            UpstreamConfig::AzureOpenai {
                endpoint,
                deployment,
                api_version,
                api_key,
                auth,
            } => Upstream::Http(http::HttpUpstream::azure(
                wiring.clone(),
                endpoint,
                deployment,
                api_version,
                api_key.as_ref(),
                *auth,
            )),
            UpstreamConfig::Gemini { base_url, api_key } => Upstream::Http(
                http::HttpUpstream::gemini(wiring.clone(), base_url, api_key.as_ref()),
            ),
            UpstreamConfig::Bedrock {
                base_url,
                region,
                credentials,
            } => Upstream::Http(http::HttpUpstream::bedrock(
                wiring.clone(),
                base_url,
                region,
                credentials,
            )),
        }
    }

    /// The same upstream with `policy` for the request members its API cannot express.
    #[must_use]
    pub fn with_unsupported_params(self, policy: dialect::UnsupportedParams) -> Upstream {
        match self {
            Upstream::Http(h) => Upstream::Http(h.with_unsupported_params(policy)),
            Upstream::Sim(_) => self,
        }
    }

    /// The members of a chat request `body` this upstream's API drops, or the first it
    /// cannot express and may not drop (only native dialects have such members;
    /// OpenAI-compatible and simulated upstreams take all).
    ///
    /// # Errors
    /// A member the API cannot express, refused.
    pub fn expressible(
        &self,
        kind: InterfaceKind,
        body: &serde_json::Value,
    ) -> Result<dialect::Dropped, dialect::Refusal> {
        match self {
            Upstream::Http(h) if kind == InterfaceKind::Chat => h.expressible(body),
            Upstream::Sim(_) | Upstream::Http(_) => Ok(dialect::Dropped::default()),
        }
    }

    /// Opens a streamed attempt; gives up if no byte arrives within `first_byte_limit`.
    pub async fn open_stream(
        &self,
        req: UpstreamRequest<'_>,
        first_byte_limit: Option<Duration>,
    ) -> StreamStart {
        match self {
            Upstream::Sim(s) => s.open_stream(req, first_byte_limit).await,
            Upstream::Http(h) => h.open_stream(req, first_byte_limit).await,
        }
    }

    /// Makes one attempt, cancelled after `timeout`.
    pub async fn call(&self, req: UpstreamRequest<'_>, timeout: Option<Duration>) -> UpstreamReply {
        match self {
            Upstream::Sim(s) => s.call(req, timeout).await,
            Upstream::Http(h) => h.call(req, timeout).await,
        }
    }
}
