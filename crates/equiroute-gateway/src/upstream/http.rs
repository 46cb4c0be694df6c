//! Upstreams over HTTP: OpenAI-compatible chat completions and generic JSON APIs.
//!
//! Classification of an attempt: 2xx → ok; 429 and 5xx → provider error (`Retry-After` is
//! honoured on both); 401, 403 and 404 → provider error too (a wrong key or model name is the
//! provider's configuration, not the caller's request, so the next provider should be tried);
//! other 4xx → client error with the provider's reason (not retried, not counted against the
//! provider); connection failures → provider error; the attempt's timeout → timeout (censored). API keys travel only in the `Authorization` header
//! to the provider and never appear in replies or errors.

use super::{UpstreamReply, UpstreamRequest};
use crate::config::Secret;
use equiroute_core::{AttemptStatus, Millis, ProviderFailure};
use std::time::{Duration, Instant};

/// An HTTP upstream.
#[derive(Clone, Debug)]
pub struct HttpUpstream {
    client: reqwest::Client,
    /// Parsed once (not on every request); `None` when the configured URL does not parse,
    /// which makes every attempt a connection failure with that reason.
    url: Option<reqwest::Url>,
    api_key: Option<Secret>,
    /// Chat upstreams get the provider's model name in the body.
    set_model: bool,
    /// `service_tier` sent to OpenAI-compatible APIs (`flex`, `priority`; none for standard).
    service_tier: Option<&'static str>,
}

impl HttpUpstream {
    /// An OpenAI-compatible upstream at `base_url`.
    #[must_use]
    pub fn openai(
        client: reqwest::Client,
        base_url: &str,
        api_key: Option<Secret>,
        tier: equiroute_core::ServiceTier,
    ) -> HttpUpstream {
        HttpUpstream {
            client,
            url: reqwest::Url::parse(&format!("{base_url}/chat/completions")).ok(),
            api_key,
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
    pub fn json(client: reqwest::Client, url: &str, api_key: Option<Secret>) -> HttpUpstream {
        HttpUpstream {
            client,
            url: reqwest::Url::parse(url).ok(),
            api_key,
            set_model: false,
            service_tier: None,
        }
    }

    /// The provider request: chat bodies get the provider's model, `stream` and the service
    /// tier; the key goes only into the `Authorization` header.
    fn request(&self, req: UpstreamRequest<'_>, stream: bool) -> reqwest::RequestBuilder {
        let body = ProviderBody {
            body: req.body,
            model: self.set_model.then_some(req.model),
            stream,
            service_tier: self.service_tier,
        };
        // Serialised straight from the client's body with the fields replaced: no copy of
        // the JSON tree per attempt.
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        // Configuration checks that URLs parse; were one not to, the send fails as a
        // connection error that names no URL.
        let builder = match &self.url {
            Some(url) => self.client.post(url.clone()),
            None => self.client.post("invalid://"),
        };
        let builder = builder
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(bytes);
        match &self.api_key {
            Some(key) => builder.bearer_auth(&key.0),
            None => builder,
        }
    }

    /// Opens a streamed chat completion; the status and the first chunk must arrive within
    /// `first_byte_limit`, else the attempt is a timeout and nothing was relayed.
    pub(crate) async fn open_stream(
        &self,
        req: UpstreamRequest<'_>,
        first_byte_limit: Option<Duration>,
    ) -> super::StreamStart {
        use futures_util::StreamExt;
        let started = Instant::now();
        let elapsed = || Millis(started.elapsed().as_secs_f64() * 1000.0);
        let builder = self.request(req, true);
        let limit = first_byte_limit.unwrap_or(Duration::from_secs(3600));
        let timed_out = |latency: Millis| UpstreamReply {
            status: AttemptStatus::Timeout,
            latency,
            body: None,
            http_status: 0,
            retry_after: None,
            reason: Some("no first byte in time".into()),
            context_overflow: false,
        };
        let first = tokio::time::timeout(limit, async {
            let response = builder
                .send()
                .await
                .map_err(|e| classify_send_error(&e, elapsed()))?;
            let code = response.status().as_u16();
            if !(200..300).contains(&code) {
                let retry_after = retry_after_of(&response);
                let text = response.bytes().await.unwrap_or_default();
                return Err(classify(code, retry_after, &text, elapsed()));
            }
            let mut stream = response.bytes_stream();
            match stream.next().await {
                Some(Ok(bytes)) => Ok((bytes, stream)),
                _ => Err(UpstreamReply {
                    status: AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
                    latency: elapsed(),
                    body: None,
                    http_status: code,
                    retry_after: None,
                    reason: Some("the stream ended before its first byte".into()),
                    context_overflow: false,
                }),
            }
        })
        .await;
        match first {
            Err(_) => super::StreamStart::Failed(timed_out(Millis(limit.as_secs_f64() * 1000.0))),
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
        let mut builder = self.request(req, false);
        if let Some(t) = timeout {
            builder = builder.timeout(t);
        }
        let reply = |status: AttemptStatus, http_status: u16, reason: String| UpstreamReply {
            status,
            latency: elapsed(),
            body: None,
            http_status,
            retry_after: None,
            reason: Some(reason),
            context_overflow: false,
        };
        let response = match builder.send().await {
            Ok(r) => r,
            Err(e) if e.is_timeout() => {
                let mut r = reply(AttemptStatus::Timeout, 0, "timed out".into());
                if let Some(t) = timeout {
                    r.latency = Millis(t.as_secs_f64() * 1000.0);
                }
                return r;
            }
            // The error's text can contain the URL but never the key (it is only a header).
            Err(e) => {
                return reply(
                    AttemptStatus::ProviderError(ProviderFailure::Connection),
                    0,
                    format!("connection failed: {}", redacted(&e)),
                )
            }
        };
        let code = response.status().as_u16();
        let retry_after = retry_after_of(&response);
        let text = match response.bytes().await {
            Ok(t) => t,
            Err(e) if e.is_timeout() => {
                return reply(
                    AttemptStatus::Timeout,
                    code,
                    "timed out reading the body".into(),
                )
            }
            Err(_) => {
                return reply(
                    AttemptStatus::ProviderError(ProviderFailure::StreamBroken),
                    code,
                    "the response body broke off".into(),
                )
            }
        };
        classify(code, retry_after, &text, elapsed())
    }
}

fn retry_after_of(response: &reqwest::Response) -> Option<Millis> {
    response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|s| Millis(s * 1000.0))
}

fn classify_send_error(e: &reqwest::Error, latency: Millis) -> UpstreamReply {
    let (status, reason) = if e.is_timeout() {
        (AttemptStatus::Timeout, "timed out".to_owned())
    } else {
        (
            AttemptStatus::ProviderError(ProviderFailure::Connection),
            format!("connection failed: {}", redacted(e)),
        )
    };
    UpstreamReply {
        status,
        latency,
        body: None,
        http_status: 0,
        retry_after: None,
        reason: Some(reason),
        context_overflow: false,
    }
}

/// The client's JSON body with the provider's fields set (`model`, `stream`, `service_tier`),
/// serialised without copying the body.
struct ProviderBody<'a> {
    body: &'a serde_json::Value,
    /// `None`: send the body as it is (JSON APIs).
    model: Option<&'a str>,
    stream: bool,
    service_tier: Option<&'static str>,
}

impl serde::Serialize for ProviderBody<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let (Some(model), Some(obj)) = (self.model, self.body.as_object()) else {
            return self.body.serialize(s);
        };
        let mut map = s.serialize_map(None)?;
        for (k, v) in obj {
            if !matches!(k.as_str(), "model" | "stream" | "service_tier") {
                map.serialize_entry(k, v)?;
            }
        }
        map.serialize_entry("model", model)?;
        map.serialize_entry("stream", &self.stream)?;
        if let Some(tier) = self.service_tier {
            map.serialize_entry("service_tier", tier)?;
        }
        map.end()
    }
}

/// The error's text with the provider's URL taken out (it may carry query parameters).
fn redacted(e: &reqwest::Error) -> String {
    let text = e.to_string();
    match e.url() {
        Some(url) => text.replace(url.as_str(), "<provider>"),
        None => text,
    }
}

/// Status, body and message of a provider's answer → the attempt's outcome.
fn classify(code: u16, retry_after: Option<Millis>, text: &[u8], latency: Millis) -> UpstreamReply {
    let json: Option<serde_json::Value> = serde_json::from_slice(text).ok();
    let message = || {
        json.as_ref()
            .and_then(|j| j.pointer("/error/message"))
            .and_then(serde_json::Value::as_str)
            .map_or_else(|| format!("HTTP {code}"), |m| format!("HTTP {code}: {m}"))
    };
    let reply = |status: AttemptStatus, reason: String| UpstreamReply {
        status,
        latency,
        body: None,
        http_status: code,
        retry_after: None,
        reason: Some(reason),
        context_overflow: false,
    };
    match code {
        200..=299 => match json {
            Some(body) => UpstreamReply {
                status: AttemptStatus::Ok,
                latency,
                body: Some(body),
                http_status: code,
                retry_after: None,
                reason: None,
                context_overflow: false,
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
            r
        }
    }
}
