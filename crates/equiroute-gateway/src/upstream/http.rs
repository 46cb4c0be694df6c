//! Upstreams over HTTP: OpenAI-compatible chat completions and generic JSON APIs.
//!
//! Classification of an attempt: 2xx → ok; 429 and 5xx → provider error (`Retry-After` is
//! honoured on both); 401, 403 and 404 → provider error too (a wrong key or model name is the
//! provider's configuration, not the caller's request, so the next provider should be tried);
//! other 4xx → client error with the provider's reason (not retried, not counted against the
//! provider); connection failures → provider error; the attempt's timeout → timeout (censored). API keys travel only in the `Authorization` header
//! to the provider and never appear in replies or errors.

use super::client::{read_body, HttpClient};
use super::{UpstreamReply, UpstreamRequest};
use crate::config::Secret;
use bytes::Bytes;
use equiroute_core::{AttemptStatus, Millis, ProviderFailure};
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use http_body_util::Full;
use std::time::{Duration, Instant};

/// An HTTP upstream.
#[derive(Clone, Debug)]
pub struct HttpUpstream {
    client: HttpClient,
    /// Parsed once (not on every request); `None` when the configured URL does not parse,
    /// which makes every attempt a connection failure with that reason.
    uri: Option<http::Uri>,
    /// `Bearer <key>`, built once and marked sensitive (never printed by `Debug`).
    authorization: Option<HeaderValue>,
    /// Chat upstreams get the provider's model name in the body.
    set_model: bool,
    /// `service_tier` sent to OpenAI-compatible APIs (`flex`, `priority`; none for standard).
    service_tier: Option<&'static str>,
}

impl HttpUpstream {
    /// An OpenAI-compatible upstream at `base_url`.
    #[must_use]
    pub fn openai(
        client: HttpClient,
        base_url: &str,
        api_key: Option<&Secret>,
        tier: equiroute_core::ServiceTier,
    ) -> HttpUpstream {
        HttpUpstream {
            client,
            uri: format!("{base_url}/chat/completions").parse().ok(),
            authorization: bearer(api_key),
            set_model: true,
            service_tier: match tier {
                equiroute_core::ServiceTier::Flex => Some("flex"),
                equiroute_core::ServiceTier::Priority => Some("priority"),
                equiroute_core::ServiceTier::Standard => None,
            },
        }
    }

    /// A JSON API at `url`.
    #[must_use]
    pub fn json(client: HttpClient, url: &str, api_key: Option<&Secret>) -> HttpUpstream {
        HttpUpstream {
            client,
            uri: url.parse().ok(),
            authorization: bearer(api_key),
            set_model: false,
            service_tier: None,
        }
    }

    /// The provider request: chat bodies get the provider's model, `stream` and the service
    /// tier; the key goes only into the `Authorization` header. `None` when the configured
    /// URL did not parse (configuration checks that it does).
    fn request(
        &self,
        req: UpstreamRequest<'_>,
        stream: bool,
    ) -> Option<http::Request<Full<Bytes>>> {
        let bytes = req.body.for_provider(
            self.set_model.then_some(req.model),
            stream,
            self.service_tier,
        );
        let mut builder = http::Request::post(self.uri.clone()?)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(auth) = &self.authorization {
            builder = builder.header(AUTHORIZATION, auth.clone());
        }
        builder.body(Full::new(bytes)).ok()
    }

    /// Sends the attempt and waits for the response head.
    async fn send(
        &self,
        req: UpstreamRequest<'_>,
        stream: bool,
    ) -> Result<http::Response<hyper::body::Incoming>, (AttemptStatus, String)> {
        let connection = AttemptStatus::ProviderError(ProviderFailure::Connection);
        let Some(request) = self.request(req, stream) else {
            return Err((
                connection,
                "connection failed: the provider URL is not valid".into(),
            ));
        };
        self.client
            .send(request)
            .await
            .map_err(|why| (connection, format!("connection failed: {why}")))
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
            if !(200..300).contains(&code) {
                let text = read_body(response.into_body()).await.unwrap_or_default();
                return Err(classify(code, retry_after, text, elapsed()));
            }
            let mut stream = response.into_body().into_data_stream();
            match stream.next().await {
                Some(Ok(bytes)) => Ok((bytes, stream)),
                _ => Err(UpstreamReply::failed(
                    AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
                    elapsed(),
                    code,
                    "the stream ended before its first byte",
                )),
            }
        })
        .await;
        match first {
            Err(_) => super::StreamStart::Failed(UpstreamReply::failed(
                AttemptStatus::Timeout,
                Millis(limit.as_secs_f64() * 1000.0),
                0,
                "no first byte in time",
            )),
            Ok(Err(reply)) => super::StreamStart::Failed(reply),
            Ok(Ok((first, stream))) => super::StreamStart::Started {
                first,
                ttfb: elapsed(),
                rest: Box::pin(
                    stream.map(|r| r.map_err(|_| "the provider's stream broke".to_owned())),
                ),
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
        let reply = |status, http_status, reason: String| {
            UpstreamReply::failed(status, elapsed(), http_status, reason)
        };
        // Sending, the response head and the whole body, all within the attempt's timeout.
        let exchange = async {
            let response = match self.send(req, false).await {
                Ok(r) => r,
                Err((status, reason)) => return reply(status, 0, reason),
            };
            let code = response.status().as_u16();
            let retry_after = retry_after_of(response.headers());
            match read_body(response.into_body()).await {
                Ok(text) => classify(code, retry_after, text, elapsed()),
                Err(why) => reply(
                    AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
                    code,
                    format!("the response body broke off: {why}"),
                ),
            }
        };
        match timeout {
            None => exchange.await,
            Some(t) => tokio::time::timeout(t, exchange).await.unwrap_or_else(|_| {
                let waited = Millis(t.as_secs_f64() * 1000.0);
                UpstreamReply::failed(AttemptStatus::Timeout, waited, 0, "timed out")
            }),
        }
    }
}

/// The `Authorization` header of a key, marked sensitive.
fn bearer(key: Option<&Secret>) -> Option<HeaderValue> {
    let mut v = HeaderValue::from_str(&format!("Bearer {}", key?.0)).ok()?;
    v.set_sensitive(true);
    Some(v)
}

fn retry_after_of(headers: &http::HeaderMap) -> Option<Millis> {
    headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|s| Millis(s * 1000.0))
}

/// Status, body and message of a provider's answer → the attempt's outcome.
fn classify(code: u16, retry_after: Option<Millis>, text: Bytes, latency: Millis) -> UpstreamReply {
    // An answer is checked and relayed as it came; only errors are read as a tree.
    let json: Option<serde_json::Value> = if (200..300).contains(&code) {
        None
    } else {
        serde_json::from_slice(&text).ok()
    };
    let message = || {
        json.as_ref()
            .and_then(|j| j.pointer("/error/message"))
            .and_then(serde_json::Value::as_str)
            .map_or_else(|| format!("HTTP {code}"), |m| format!("HTTP {code}: {m}"))
    };
    let reply = |status, reason: String| UpstreamReply::failed(status, latency, code, reason);
    match code {
        200..=299 => match super::answer::ProviderJson::parse(text) {
            Some(body) => UpstreamReply {
                status: AttemptStatus::Ok,
                latency,
                body: Some(body),
                http_status: code,
                retry_after: None,
                reason: None,
                context_overflow: false,
                content_filter: false,
            },
            None => reply(
                AttemptStatus::ProviderError(ProviderFailure::Server),
                format!("HTTP {code} with a body that is not JSON"),
            ),
        },
        429 | 500..=599 => {
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
            r.context_overflow = code == 400
                && (code_of == Some("context_length_exceeded")
                    || message.contains("maximum context length"));
            r.content_filter = code_of == Some("content_filter");
            r
        }
    }
}
