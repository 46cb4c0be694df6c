//! Upstreams over HTTP: OpenAI-compatible chat completions (OpenAI, Azure OpenAI and
//! compatible hosts), the native dialects (Anthropic Messages, Gemini; see `dialect`) and
//! generic JSON APIs.
//!
//! Classification of an attempt: 2xx → ok; 429 and 5xx → provider error (`Retry-After` is
//! honoured on both); 401, 403 and 404 → provider error too (a wrong key or model name is the
//! provider's configuration, not the caller's request, so the next provider should be tried);
//! other 4xx → client error with the provider's reason (not retried, not counted against the
//! provider); connection failures → provider error; the attempt's timeout → timeout
//! (censored). A request a dialect cannot express and a safety block in a 2xx answer are client
//! errors too. API keys travel only in their header to the provider (marked sensitive). Every
//! text of a provider's (error messages, AWS error types, transport errors, which may quote
//! the request's headers or URL) becomes a reason through the gateway's
//! [`Redactor`](crate::redact::Redactor) only: an attempt's reason is a
//! [`Redacted`](crate::redact::Redacted), which nothing else can make.

use super::client::{read_body, HttpClient};
use super::dialect::{self, Dropped, Leftovers, Refusal, Unanswerable, UnsupportedParams};
use super::{anthropic, bedrock, gemini, UpstreamReply, UpstreamRequest};
use crate::config::{AwsCredentials, AzureAuth, Secret};
use crate::redact::{Redacted, Redactor};
use bytes::Bytes;
use equiroute_core::{AttemptStatus, Millis, ProviderFailure};
use http::header::{HeaderName, HeaderValue, AUTHORIZATION, CONTENT_TYPE, USER_AGENT};
use http_body_util::Full;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The `User-Agent` of every upstream request: providers' logs and support see the gateway.
pub const USER_AGENT_VALUE: &str = concat!("equiroute/", env!("CARGO_PKG_VERSION"));

/// What every HTTP upstream is built with: the shared connection pool, and the redactor of
/// the gateway's secrets that every text of the provider's passes through.
#[derive(Clone, Debug)]
pub struct Wiring {
    pub client: HttpClient,
    pub redactor: Arc<Redactor>,
}

/// An HTTP upstream.
#[derive(Clone, Debug)]
pub struct HttpUpstream {
    client: HttpClient,
    redactor: Arc<Redactor>,
    /// Parsed once (not on every request); `None` when the configured URL does not parse,
    /// which makes every attempt a connection failure with that reason.
    uri: Option<http::Uri>,
    /// The key's header and the dialect's own, built once; keys are marked sensitive (never
    /// printed by `Debug`).
    headers: Vec<(HeaderName, HeaderValue)>,
    /// What the provider's bodies are written in.
    dialect: Dialect,
    /// `service_tier` sent to OpenAI-compatible APIs (`flex`, `priority`; none for standard).
    service_tier: Option<&'static str>,
    /// What a native dialect does with members it cannot express.
    unsupported_params: UnsupportedParams,
}

/// The language of a provider's request and answer bodies.
#[derive(Clone, Debug)]
enum Dialect {
    /// OpenAI's chat completions: the client's bytes with the provider's `model` and `stream`.
    OpenAi,
    /// A JSON API: the client's bytes as they came.
    Json,
    /// Anthropic's Messages API; `max_tokens` when the client gives none.
    Anthropic { max_tokens: u32 },
    /// Gemini's `generateContent`: the URL names the model and the method.
    Gemini { base_url: String },
    /// Bedrock's Converse: the URL names the model and the method; each request is signed.
    Bedrock {
        base_url: String,
        region: String,
        credentials: AwsCredentials,
    },
}

impl HttpUpstream {
    /// The provider's name in OpenTelemetry's `gen_ai.provider.name` (Azure deployments speak
    /// OpenAI's dialect and are named `openai`).
    #[must_use]
    pub fn system(&self) -> &'static str {
        match self.dialect {
            Dialect::OpenAi => "openai",
            Dialect::Json => "http",
            Dialect::Anthropic { .. } => "anthropic",
            Dialect::Gemini { .. } => "gcp.gemini",
            Dialect::Bedrock { .. } => "aws.bedrock",
        }
    }

    /// The same upstream with `policy` for the members its dialect cannot express.
    #[must_use]
    pub fn with_unsupported_params(self, policy: UnsupportedParams) -> HttpUpstream {
        HttpUpstream {
            unsupported_params: policy,
            ..self
        }
    }

    /// An OpenAI-compatible upstream at `base_url`.
    #[must_use]
    pub fn openai(
        wiring: Wiring,
        base_url: &str,
        api_key: Option<&Secret>,
        tier: equiroute_core::ServiceTier,
    ) -> HttpUpstream {
        HttpUpstream {
            client: wiring.client,
            redactor: wiring.redactor,
            uri: format!("{base_url}/chat/completions").parse().ok(),
            headers: bearer(api_key).into_iter().collect(),
            dialect: Dialect::OpenAi,
            service_tier: match tier {
                equiroute_core::ServiceTier::Flex => Some("flex"),
                equiroute_core::ServiceTier::Priority => Some("priority"),
                equiroute_core::ServiceTier::Standard => None,
            },
            unsupported_params: UnsupportedParams::default(),
        }
    }

    /// A JSON API at `url`.
    #[must_use]
    pub fn json(wiring: Wiring, url: &str, api_key: Option<&Secret>) -> HttpUpstream {
        HttpUpstream {
            client: wiring.client,
            redactor: wiring.redactor,
            uri: url.parse().ok(),
            headers: bearer(api_key).into_iter().collect(),
            dialect: Dialect::Json,
            service_tier: None,
            unsupported_params: UnsupportedParams::default(),
        }
    }

    /// An Azure OpenAI deployment: `{endpoint}/openai/deployments/{deployment}/chat/completions
    /// ?api-version=...`, the key in `api-key` (or as a bearer token).
    #[must_use]
    pub fn azure(
        wiring: Wiring,
        endpoint: &str,
        deployment: &str,
        api_version: &str,
        api_key: Option<&Secret>,
        auth: AzureAuth,
    ) -> HttpUpstream {
        let headers = match auth {
            AzureAuth::ApiKey => key_header("api-key", api_key),
            AzureAuth::Bearer => bearer(api_key).into_iter().collect(),
        };
        HttpUpstream {
            client: wiring.client,
            redactor: wiring.redactor,
            uri: format!(
                "{endpoint}/openai/deployments/{deployment}/chat/completions?api-version={api_version}"
            )
            .parse()
            .ok(),
            headers,
            dialect: Dialect::OpenAi,
            service_tier: None,
            unsupported_params: UnsupportedParams::default(),
        }
    }

    /// Anthropic's Messages API at `{base_url}/messages`, the key in `x-api-key`.
    #[must_use]
    pub fn anthropic(
        wiring: Wiring,
        base_url: &str,
        api_key: Option<&Secret>,
        version: &str,
        max_tokens: u32,
    ) -> HttpUpstream {
        let mut headers = key_header("x-api-key", api_key);
        if let Ok(v) = HeaderValue::from_str(version) {
            headers.push((HeaderName::from_static("anthropic-version"), v));
        }
        HttpUpstream {
            client: wiring.client,
            redactor: wiring.redactor,
            uri: format!("{base_url}/messages").parse().ok(),
            headers,
            dialect: Dialect::Anthropic { max_tokens },
            service_tier: None,
            unsupported_params: UnsupportedParams::default(),
        }
    }

    /// Gemini's API at `{base_url}/models/{model}:generateContent` (and
    /// `:streamGenerateContent?alt=sse`), the key in `x-goog-api-key`.
    #[must_use]
    pub fn gemini(wiring: Wiring, base_url: &str, api_key: Option<&Secret>) -> HttpUpstream {
        HttpUpstream {
            client: wiring.client,
            redactor: wiring.redactor,
            uri: None,
            headers: key_header("x-goog-api-key", api_key),
            dialect: Dialect::Gemini {
                base_url: base_url.to_owned(),
            },
            service_tier: None,
            unsupported_params: UnsupportedParams::default(),
        }
    }

    /// Bedrock's Converse API at `{base_url}/model/{model}/converse` (and `/converse-stream`),
    /// each request signed (AWS Signature Version 4) for `region`.
    #[must_use]
    pub fn bedrock(
        wiring: Wiring,
        base_url: &str,
        region: &str,
        credentials: &AwsCredentials,
    ) -> HttpUpstream {
        HttpUpstream {
            client: wiring.client,
            redactor: wiring.redactor,
            uri: None,
            headers: Vec::new(),
            dialect: Dialect::Bedrock {
                base_url: base_url.to_owned(),
                region: region.to_owned(),
                credentials: credentials.clone(),
            },
            service_tier: None,
            unsupported_params: UnsupportedParams::default(),
        }
    }

    /// The URL and body of an attempt in the provider's dialect.
    fn body(
        &self,
        req: UpstreamRequest<'_>,
        stream: bool,
    ) -> Result<(Option<http::Uri>, Bytes), Refusal> {
        let json = |v: serde_json::Value| Bytes::from(serde_json::to_vec(&v).unwrap_or_default());
        let mut leftovers = Leftovers::new(self.unsupported_params);
        Ok(match &self.dialect {
            Dialect::OpenAi => (
                self.uri.clone(),
                req.body
                    .for_provider(Some(req.model), stream, self.service_tier),
            ),
            Dialect::Json => (self.uri.clone(), req.body.for_provider(None, stream, None)),
            Dialect::Anthropic { max_tokens } => (
                self.uri.clone(),
                json(anthropic::request(
                    req.body.json(),
                    req.model,
                    (stream, *max_tokens),
                    &mut leftovers,
                )?),
            ),
            Dialect::Gemini { base_url } => {
                let method = if stream {
                    "streamGenerateContent?alt=sse"
                } else {
                    "generateContent"
                };
                (
                    format!("{base_url}/models/{}:{method}", req.model)
                        .parse()
                        .ok(),
                    json(gemini::request(req.body.json(), &mut leftovers)?),
                )
            }
            Dialect::Bedrock { base_url, .. } => {
                // The model id is one path segment: an ARN's `/` and a version's `:` are
                // escaped, as AWS's SDKs send them.
                let model = req.model.replace(':', "%3A").replace('/', "%2F");
                let method = if stream {
                    "converse-stream"
                } else {
                    "converse"
                };
                (
                    format!("{base_url}/model/{model}/{method}").parse().ok(),
                    json(bedrock::request(req.body.json(), &mut leftovers)?),
                )
            }
        })
    }

    /// The members of `body` the dialect drops, or the first it cannot express and may not
    /// drop (the translation, done and thrown away: the attempt translates again with the
    /// provider's model, the same way).
    pub(crate) fn expressible(&self, body: &serde_json::Value) -> Result<Dropped, Refusal> {
        let mut leftovers = Leftovers::new(self.unsupported_params);
        match &self.dialect {
            Dialect::OpenAi | Dialect::Json => return Ok(Dropped::default()),
            Dialect::Anthropic { max_tokens } => {
                anthropic::request(body, "", (false, *max_tokens), &mut leftovers)?;
            }
            Dialect::Gemini { .. } => {
                gemini::request(body, &mut leftovers)?;
            }
            Dialect::Bedrock { .. } => {
                bedrock::request(body, &mut leftovers)?;
            }
        }
        Ok(leftovers.dropped())
    }

    /// The stream translation of a native dialect (`None`: relayed as it came).
    fn translation(&self, req: UpstreamRequest<'_>) -> Option<Box<dyn dialect::StreamTranslator>> {
        let usage = req
            .body
            .as_object()
            .is_some_and(dialect::wants_stream_usage);
        let inner: Box<dyn dialect::EventTranslator> = match self.dialect {
            Dialect::OpenAi | Dialect::Json => return None,
            Dialect::Anthropic { .. } => {
                Box::new(anthropic::StreamTranslation::new(req.model, usage))
            }
            Dialect::Gemini { .. } => Box::new(gemini::StreamTranslation::new(req.model, usage)),
            Dialect::Bedrock { .. } => {
                return Some(Box::new(bedrock::StreamTranslation::new(req.model, usage)))
            }
        };
        Some(Box::new(dialect::SseTranslator::new(inner)))
    }

    /// A 2xx body as an OpenAI answer naming `model`.
    fn answer(&self, text: Bytes, model: &str) -> Result<Bytes, Unanswerable> {
        let translate =
            |f: fn(&serde_json::Value, &str) -> Result<serde_json::Value, Unanswerable>| {
                let v: serde_json::Value = serde_json::from_slice(&text)
                    .map_err(|_| Unanswerable::Malformed("a body that is not JSON".into()))?;
                Ok(Bytes::from(
                    serde_json::to_vec(&f(&v, model)?).unwrap_or_default(),
                ))
            };
        match self.dialect {
            Dialect::OpenAi | Dialect::Json => Ok(text),
            Dialect::Anthropic { .. } => translate(anthropic::answer),
            Dialect::Gemini { .. } => translate(gemini::answer),
            Dialect::Bedrock { .. } => translate(bedrock::answer),
        }
    }

    /// The provider request: OpenAI chat bodies get the provider's model, `stream` and the
    /// service tier, native dialects a body of their own; the key goes only into its header.
    /// `Ok(None)` when the URL did not parse (configuration checks that it does).
    fn request(
        &self,
        req: UpstreamRequest<'_>,
        stream: bool,
    ) -> Result<Option<http::Request<Full<Bytes>>>, Refusal> {
        let (uri, bytes) = self.body(req, stream)?;
        let Some(uri) = uri else { return Ok(None) };
        let mut builder = http::Request::post(uri)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        for (name, value) in &self.headers {
            builder = builder.header(name, value.clone());
        }
        let Ok(mut request) = builder.body(Full::new(bytes.clone())) else {
            return Ok(None);
        };
        // A configured `User-Agent` header wins. SigV4 leaves it unsigned, as botocore does.
        request
            .headers_mut()
            .entry(USER_AGENT)
            .or_insert(HeaderValue::from_static(USER_AGENT_VALUE));
        if let Dialect::Bedrock {
            region,
            credentials,
            ..
        } = &self.dialect
        {
            if bedrock::sign(
                &mut request,
                &bytes,
                credentials,
                region,
                std::time::SystemTime::now(),
            )
            .is_err()
            {
                return Ok(None);
            }
        }
        Ok(Some(request))
    }

    /// Sends the attempt and waits for the response head.
    async fn send(
        &self,
        req: UpstreamRequest<'_>,
        stream: bool,
    ) -> Result<http::Response<hyper::body::Incoming>, (AttemptStatus, Redacted)> {
        let connection = AttemptStatus::ProviderError(ProviderFailure::Connection);
        let request = match self.request(req, stream) {
            Ok(Some(r)) => r,
            Ok(None) => {
                return Err((
                    connection,
                    Redacted::fixed("connection failed: the provider URL is not valid"),
                ))
            }
            // Not sent: the caller's request, not the provider, is at fault.
            Err(refusal) => {
                return Err((
                    AttemptStatus::ClientError,
                    self.redactor.redact(&refusal.reason()),
                ))
            }
        };
        // A transport error may quote the URL (and a key in its query).
        self.client.send(request).await.map_err(|why| {
            let text = format!("connection failed: {why}");
            (connection, self.redactor.redact(&text))
        })
    }

    /// Opens a streamed chat completion; the status and the first chunk must arrive within
    /// `first_byte_limit`, else the attempt is a timeout and nothing was relayed.
    pub(crate) async fn open_stream(
        &self,
        req: UpstreamRequest<'_>,
        first_byte_limit: Option<Duration>,
    ) -> super::StreamStart {
        use futures_util::StreamExt;
        use http_body_util::BodyExt;
        let started = Instant::now();
        let elapsed = || Millis(started.elapsed().as_secs_f64() * 1000.0);
        let limit = first_byte_limit.unwrap_or(Duration::from_secs(3600));
        let first = tokio::time::timeout(limit, async {
            let response = self
                .send(req, true)
                .await
                .map_err(|(status, reason)| UpstreamReply::failed(status, elapsed(), 0, reason))?;
            let code = response.status().as_u16();
            let retry_after = retry_after_of(response.headers());
            let capacity = super::limits::Capacity::of(response.headers(), unix_ms());
            if !(200..300).contains(&code) {
                let error_type = aws_error_type_of(response.headers());
                let text = read_body(response.into_body()).await.unwrap_or_default();
                let head = Head {
                    code,
                    retry_after,
                    error_type,
                };
                return Err(self.classify(&head, text, elapsed(), req.model));
            }
            let mut stream: super::ChunkStream = Box::pin(
                response
                    .into_body()
                    .into_data_stream()
                    .map(|r| r.map_err(|_| "the provider's stream broke".to_owned())),
            );
            if let Some(translation) = self.translation(req) {
                stream = dialect::translate_stream(stream, translation);
            }
            match stream.next().await {
                Some(Ok(bytes)) => Ok((bytes, stream, capacity)),
                _ => Err(UpstreamReply::failed(
                    AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
                    elapsed(),
                    code,
                    Redacted::fixed("the stream ended before its first byte"),
                )),
            }
        })
        .await;
        match first {
            Err(_) => super::StreamStart::Failed(UpstreamReply::failed(
                AttemptStatus::Timeout,
                Millis(limit.as_secs_f64() * 1000.0),
                0,
                Redacted::fixed("no first byte in time"),
            )),
            Ok(Err(reply)) => super::StreamStart::Failed(reply),
            Ok(Ok((first, rest, capacity))) => super::StreamStart::Started {
                first,
                ttfb: elapsed(),
                rest,
                capacity,
            },
        }
    }

    pub(crate) async fn call(
        &self,
        req: UpstreamRequest<'_>,
        timeout: Option<Duration>,
    ) -> UpstreamReply {
        let started = Instant::now();
        let elapsed = || Millis(started.elapsed().as_secs_f64() * 1000.0);
        let reply = |status, http_status, reason: Redacted| {
            UpstreamReply::failed(status, elapsed(), http_status, reason)
        };
        // Sending, the response head and the whole body, all within the attempt's timeout.
        let exchange = async {
            let response = match self.send(req, false).await {
                Ok(r) => r,
                Err((status, reason)) => return reply(status, 0, reason),
            };
            let code = response.status().as_u16();
            let head = Head {
                code,
                retry_after: retry_after_of(response.headers()),
                error_type: aws_error_type_of(response.headers()),
            };
            let capacity = super::limits::Capacity::of(response.headers(), unix_ms());
            match read_body(response.into_body()).await {
                Ok(text) => UpstreamReply {
                    capacity,
                    ..self.classify(&head, text, elapsed(), req.model)
                },
                Err(why) => reply(
                    AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
                    code,
                    self.redactor
                        .redact(&format!("the response body broke off: {why}")),
                ),
            }
        };
        match timeout {
            None => exchange.await,
            Some(t) => tokio::time::timeout(t, exchange).await.unwrap_or_else(|_| {
                let waited = Millis(t.as_secs_f64() * 1000.0);
                UpstreamReply::failed(
                    AttemptStatus::Timeout,
                    waited,
                    0,
                    Redacted::fixed("timed out"),
                )
            }),
        }
    }
}

/// The `Authorization` header of a key, marked sensitive.
fn bearer(key: Option<&Secret>) -> Option<(HeaderName, HeaderValue)> {
    let mut v = HeaderValue::from_str(&format!("Bearer {}", key?.0)).ok()?;
    v.set_sensitive(true);
    Some((AUTHORIZATION, v))
}

/// A key in a header of its own (`x-api-key`, `api-key`, ...), marked sensitive.
fn key_header(name: &'static str, key: Option<&Secret>) -> Vec<(HeaderName, HeaderValue)> {
    key.and_then(|k| HeaderValue::from_str(&k.0).ok())
        .map(|mut v| {
            v.set_sensitive(true);
            (HeaderName::from_static(name), v)
        })
        .into_iter()
        .collect()
}

/// What classification reads of a response head.
struct Head {
    code: u16,
    retry_after: Option<Millis>,
    /// AWS's `x-amzn-errortype` (Bedrock's error type).
    error_type: Option<String>,
}

fn aws_error_type_of(headers: &http::HeaderMap) -> Option<String> {
    // A name made once: a name given as text is parsed again at every lookup, and this one
    // is looked up in every answer.
    const AWS_ERROR_TYPE: http::HeaderName = http::HeaderName::from_static("x-amzn-errortype");
    headers
        .get(AWS_ERROR_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Wall-clock milliseconds since the Unix epoch (rate-limit reset times are wall-clock).
fn unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

fn retry_after_of(headers: &http::HeaderMap) -> Option<Millis> {
    headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|s| Millis(s * 1000.0))
}

impl HttpUpstream {
    /// Bedrock's errors by their AWS type (`x-amzn-errortype`); `None` for an answer, another
    /// dialect, or a type Bedrock does not document (classified by status then).
    fn classify_bedrock(
        &self,
        head: &Head,
        json: Option<&serde_json::Value>,
        message: &str,
        latency: Millis,
    ) -> Option<UpstreamReply> {
        let code = head.code;
        let reply = |status, reason: String| {
            UpstreamReply::failed(status, latency, code, self.redactor.redact(&reason))
        };
        if !matches!(self.dialect, Dialect::Bedrock { .. }) || (200..300).contains(&code) {
            return None;
        }
        let kind = bedrock::error_type(head.error_type.as_deref(), json)?;
        let class = bedrock::error_class(&kind)?;
        let detail = || format!("{message} ({kind})");
        let mut r = match class {
            bedrock::ErrorClass::RateLimited => reply(
                AttemptStatus::ProviderError(ProviderFailure::RateLimited),
                detail(),
            ),
            bedrock::ErrorClass::Server => reply(
                AttemptStatus::ProviderError(ProviderFailure::Server),
                detail(),
            ),
            // AWS's own text may quote the signed request: a fixed reason instead.
            bedrock::ErrorClass::Credentials => reply(
                AttemptStatus::ProviderError(ProviderFailure::Server),
                format!(
                    "HTTP {code} ({kind}): Bedrock refused the gateway's AWS credentials or the \
                     model's access; check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, \
                     AWS_SESSION_TOKEN, the region and the model id"
                ),
            ),
            bedrock::ErrorClass::Client => {
                let mut r = reply(AttemptStatus::ClientError, detail());
                r.context_overflow = bedrock::is_context_overflow(message);
                r
            }
        };
        r.retry_after = head.retry_after;
        Some(r)
    }

    /// Status, body and message of a provider's answer → the attempt's outcome; every text of
    /// the provider's in the reason is redacted.
    fn classify(&self, head: &Head, text: Bytes, latency: Millis, model: &str) -> UpstreamReply {
        let (code, retry_after) = (head.code, head.retry_after);
        // An answer is checked and relayed as it came; only errors are read as a tree.
        let json: Option<serde_json::Value> = if (200..300).contains(&code) {
            None
        } else {
            serde_json::from_slice(&text).ok()
        };
        let message = || {
            json.as_ref()
                .and_then(|j| j.pointer("/error/message").or_else(|| j.get("message")))
                .and_then(serde_json::Value::as_str)
                .map_or_else(|| format!("HTTP {code}"), |m| format!("HTTP {code}: {m}"))
        };
        let reply = |status, reason: String| {
            UpstreamReply::failed(status, latency, code, self.redactor.redact(&reason))
        };
        if let Some(r) = self.classify_bedrock(head, json.as_ref(), &message(), latency) {
            return r;
        }
        match code {
            200..=299 => match self
                .answer(text, model)
                .map(super::answer::ProviderJson::parse)
            {
                Err(Unanswerable::Blocked(why)) => {
                    let mut r = reply(AttemptStatus::ClientError, why);
                    r.content_filter = true;
                    r
                }
                Err(Unanswerable::Malformed(why)) => reply(
                    AttemptStatus::ProviderError(ProviderFailure::Server),
                    format!("HTTP {code} with {why}"),
                ),
                Ok(Some(body)) => UpstreamReply {
                    status: AttemptStatus::Ok,
                    latency,
                    body: Some(body),
                    http_status: code,
                    retry_after: None,
                    capacity: super::limits::Capacity::default(),
                    reason: None,
                    context_overflow: false,
                    content_filter: false,
                },
                Ok(None) => reply(
                    AttemptStatus::ProviderError(ProviderFailure::Server),
                    format!("HTTP {code} with a body that is not JSON"),
                ),
            },
            // A content filter's refusal is the request's, whatever the status (OpenAI has
            // sent `content_policy_violation` with a 400 and with a 403).
            400..=499 if code != 429 && json.as_ref().is_some_and(is_content_filter) => {
                let mut r = reply(AttemptStatus::ClientError, message());
                r.content_filter = true;
                r
            }
            // 401, 403 and 404: a wrong key or model name in the gateway's configuration.
            401 | 403 | 404 | 429 | 500..=599 => {
                let failure = if code == 429 {
                    ProviderFailure::RateLimited
                } else {
                    ProviderFailure::Server
                };
                let mut r = reply(AttemptStatus::ProviderError(failure), message());
                r.retry_after = retry_after;
                r
            }
            _ => {
                let code_of = json
                    .as_ref()
                    .and_then(|j| j.pointer("/error/code"))
                    .and_then(serde_json::Value::as_str);
                let message = message();
                let mut r = reply(AttemptStatus::ClientError, message.clone());
                // OpenAI's code and message, Anthropic's and Gemini's messages.
                r.context_overflow = code == 400
                    && (code_of == Some("context_length_exceeded")
                        || message.contains("maximum context length")
                        || message.contains("prompt is too long")
                        || message.contains("exceeds the maximum number of tokens"));
                r
            }
        }
    }
}

/// Whether an error body is a content filter's refusal: `error.code` `content_filter`
/// (Azure OpenAI) or `content_policy_violation` (OpenAI), or Azure's inner error code
/// `ResponsibleAIPolicyViolation`. Anthropic's API has no such error (its refusals are the
/// `refusal` stop reason, read from the answer), nor has Gemini's (`promptFeedback`).
fn is_content_filter(json: &serde_json::Value) -> bool {
    let code = |pointer: &str| json.pointer(pointer).and_then(serde_json::Value::as_str);
    matches!(
        code("/error/code"),
        Some("content_filter" | "content_policy_violation")
    ) || ["/error/innererror/code", "/error/inner_error/code"]
        .iter()
        .any(|p| code(p) == Some("ResponsibleAIPolicyViolation"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY_ID: &str = "AKIATESTKEYID0000";
    const SECRET: &str = "test-secret-never-shown";
    const TOKEN: &str = "test-session-token-never-shown";

    fn bedrock_upstream() -> HttpUpstream {
        let credentials = AwsCredentials::new(KEY_ID, SECRET, Some(TOKEN));
        let wiring = Wiring {
            client: HttpClient::new(),
            redactor: Arc::new(Redactor::new(credentials.values())),
        };
        HttpUpstream::bedrock(wiring, "http://127.0.0.1:1", "us-east-1", &credentials)
    }

    #[test]
    fn every_upstream_request_says_it_comes_from_equiroute() {
        let up = bedrock_upstream();
        let body = crate::upstream::ClientBody::from_json(
            serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}),
        );
        let req = UpstreamRequest {
            kind: crate::config::InterfaceKind::Chat,
            body: &body,
            model: "m",
            seed: 0,
        };
        let request = up.request(req, false).unwrap().unwrap();
        let agent = request.headers()[USER_AGENT].to_str().unwrap();
        assert_eq!(agent, format!("equiroute/{}", env!("CARGO_PKG_VERSION")));
        assert!(agent.len() > "equiroute/".len());
    }

    fn head(code: u16, kind: &str) -> Head {
        Head {
            code,
            retry_after: None,
            error_type: Some(format!("{kind}:http://internal.amazon.com/coral/")),
        }
    }

    #[test]
    fn no_aws_credential_reaches_a_reason_or_a_debug_line() {
        let up = bedrock_upstream();
        assert!(
            ![KEY_ID, SECRET, TOKEN]
                .iter()
                .any(|s| format!("{up:?}").contains(s)),
            "Debug of the upstream"
        );
        // A host that echoes what it got: every value is cut from the reason, whatever class.
        let echo = format!(
            r#"{{"message": "bad request; x-amz-security-token:{TOKEN} Credential={KEY_ID} {SECRET}"}}"#
        );
        for (code, kind, status) in [
            (400, "ValidationException", AttemptStatus::ClientError),
            (
                429,
                "ThrottlingException",
                AttemptStatus::ProviderError(ProviderFailure::RateLimited),
            ),
            (
                403,
                "InvalidSignatureException",
                AttemptStatus::ProviderError(ProviderFailure::Server),
            ),
            (418, "SomethingNewException", AttemptStatus::ClientError),
        ] {
            let r = up.classify(
                &head(code, kind),
                Bytes::from(echo.clone()),
                Millis(1.0),
                "m",
            );
            assert_eq!(r.status, status, "{kind}");
            let reason = r.reason.unwrap().as_str().to_owned();
            for secret in [KEY_ID, SECRET, TOKEN] {
                assert!(!reason.contains(secret), "{kind}: {reason}");
            }
            if kind == "InvalidSignatureException" {
                assert!(reason.contains("AWS_ACCESS_KEY_ID"), "{reason}");
            } else {
                assert!(reason.contains("<redacted>"), "{kind}: {reason}");
            }
        }
    }

    fn wiring() -> Wiring {
        Wiring {
            client: HttpClient::new(),
            redactor: Arc::new(Redactor::new(Vec::new())),
        }
    }

    /// `(status, content_filter)` of an error answer `code` with `body`.
    fn refusal(up: &HttpUpstream, code: u16, body: &str) -> (AttemptStatus, bool) {
        let head = Head {
            code,
            retry_after: None,
            error_type: None,
        };
        let r = up.classify(&head, Bytes::from(body.to_owned()), Millis(1.0), "m");
        (r.status, r.content_filter)
    }

    #[test]
    fn each_dialect_s_content_policy_refusal_is_a_content_filter() {
        let openai = HttpUpstream::openai(
            wiring(),
            "http://127.0.0.1:1",
            None,
            equiroute_core::ServiceTier::Standard,
        );
        let filtered = (AttemptStatus::ClientError, true);
        // OpenAI: `content_policy_violation`, seen with a 400 and with a 403 (which would
        // otherwise be read as the gateway's key or model being wrong).
        let policy = r#"{"error": {"message": "Your request was rejected as a result of our safety system.", "type": "invalid_request_error", "param": null, "code": "content_policy_violation"}}"#;
        assert_eq!(refusal(&openai, 400, policy), filtered);
        assert_eq!(refusal(&openai, 403, policy), filtered);
        // Azure OpenAI: `content_filter`, with or without its inner error code, or the inner
        // code alone.
        let azure = HttpUpstream::azure(
            wiring(),
            "http://127.0.0.1:1",
            "d",
            "2024-10-21",
            None,
            AzureAuth::ApiKey,
        );
        let both = r#"{"error": {"message": "The response was filtered due to the prompt triggering Azure OpenAI's content management policy.", "type": null, "param": "prompt", "code": "content_filter", "status": 400, "innererror": {"code": "ResponsibleAIPolicyViolation", "content_filter_result": {"hate": {"filtered": true, "severity": "high"}}}}}"#;
        assert_eq!(refusal(&azure, 400, both), filtered);
        let inner = r#"{"error": {"message": "filtered", "code": "BadRequest", "innererror": {"code": "ResponsibleAIPolicyViolation"}}}"#;
        assert_eq!(refusal(&azure, 400, inner), filtered);
        // Anthropic's API has no such error: its 400s are ordinary rejections (its refusals
        // are the `refusal` stop reason of an answer).
        let anthropic =
            HttpUpstream::anthropic(wiring(), "http://127.0.0.1:1", None, "2023-06-01", 1024);
        let invalid = r#"{"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: too large"}}"#;
        assert_eq!(
            refusal(&anthropic, 400, invalid),
            (AttemptStatus::ClientError, false)
        );
        // Other codes are not refusals; a 403 without one is the gateway's key, a provider
        // error; a 429 is never a refusal.
        let other = r#"{"error": {"message": "bad", "code": "invalid_value"}}"#;
        assert_eq!(
            refusal(&openai, 400, other),
            (AttemptStatus::ClientError, false)
        );
        let forbidden = r#"{"error": {"message": "wrong project", "code": "unsupported_country_region_territory"}}"#;
        assert_eq!(
            refusal(&openai, 403, forbidden),
            (AttemptStatus::ProviderError(ProviderFailure::Server), false)
        );
        assert_eq!(
            refusal(&openai, 429, policy),
            (
                AttemptStatus::ProviderError(ProviderFailure::RateLimited),
                false
            )
        );
    }

    #[test]
    fn a_too_long_prompt_is_a_context_overflow_and_retry_after_is_kept() {
        let up = bedrock_upstream();
        let r = up.classify(
            &head(400, "ValidationException"),
            Bytes::from(r#"{"message": "The model returned the following errors: Input is too long for requested model."}"#),
            Millis(1.0),
            "m",
        );
        assert!(r.context_overflow && r.status == AttemptStatus::ClientError);
        let mut h = head(503, "ServiceUnavailableException");
        h.retry_after = Some(Millis(2000.0));
        let r = up.classify(&h, Bytes::from(r#"{"message": "busy"}"#), Millis(1.0), "m");
        assert_eq!(
            r.status,
            AttemptStatus::ProviderError(ProviderFailure::Server)
        );
        assert_eq!(r.retry_after, Some(Millis(2000.0)));
    }
}
