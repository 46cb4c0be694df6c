//! The in-process simulated provider: the log-normal latency model the laboratory also uses
//! (`equiroute_core::latency`) in real time, with configurable 500s and 429s, answering in the
//! interface's wire format.

use super::{UpstreamReply, UpstreamRequest};
use crate::config::{InterfaceKind, SimSpec};
use crate::redact::Redacted;
use equiroute_core::latency::LogNormal;
use equiroute_core::{AttemptStatus, Millis, ProviderFailure};
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::time::Duration;

/// A simulated provider.
#[derive(Clone, Debug)]
pub struct SimUpstream {
    id: String,
    spec: SimSpec,
    latency: LogNormal,
}

impl SimUpstream {
    /// A simulated provider named `id`.
    #[must_use]
    pub fn new(id: &str, spec: SimSpec) -> SimUpstream {
        SimUpstream {
            id: id.to_owned(),
            latency: LogNormal::from_p50_p95(spec.latency.p50_ms, spec.latency.p95_ms),
            spec,
        }
    }

    pub(crate) async fn call(
        &self,
        req: UpstreamRequest<'_>,
        timeout: Option<Duration>,
    ) -> UpstreamReply {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(req.seed);
        let failure = |latency: f64, f: ProviderFailure, http_status: u16, reason: &'static str| {
            UpstreamReply::failed(
                AttemptStatus::ProviderError(f),
                Millis(latency),
                http_status,
                Redacted::fixed(reason),
            )
        };
        if rng.random::<f64>() < self.spec.rate_limit_rate {
            let mut r = failure(
                0.0,
                ProviderFailure::RateLimited,
                429,
                "rate limited (simulated)",
            );
            r.retry_after = Some(Millis(1000.0));
            return r;
        }
        let latency_ms = self.latency.sample(&mut rng);
        let wait = Duration::from_secs_f64(latency_ms / 1000.0);
        if let Some(limit) = timeout {
            if wait > limit {
                tokio::time::sleep(limit).await;
                return UpstreamReply::failed(
                    AttemptStatus::Timeout,
                    Millis(limit.as_secs_f64() * 1000.0),
                    0,
                    Redacted::fixed("timed out"),
                );
            }
        }
        if rng.random::<f64>() < self.spec.failure_rate {
            let quick = wait.mul_f64(0.3);
            tokio::time::sleep(quick).await;
            return failure(
                quick.as_secs_f64() * 1000.0,
                ProviderFailure::Server,
                500,
                "server error (simulated)",
            );
        }
        tokio::time::sleep(wait).await;
        UpstreamReply {
            status: AttemptStatus::Ok,
            latency: Millis(latency_ms),
            body: Some(super::answer::ProviderJson::from_value(&self.answer(req))),
            http_status: 200,
            retry_after: None,
            capacity: super::limits::Capacity::default(),
            reason: None,
            context_overflow: false,
            content_filter: false,
        }
    }

    /// A streamed answer in OpenAI's chunk format: the first chunk after the sampled latency
    /// (the time to first byte), then one chunk per word 5 ms apart, then `[DONE]`.
    pub(crate) async fn open_stream(
        &self,
        req: UpstreamRequest<'_>,
        first_byte_limit: Option<Duration>,
    ) -> super::StreamStart {
        let full = self.call(req, first_byte_limit).await;
        let Some(body) = full
            .body
            .as_ref()
            .and_then(super::answer::ProviderJson::value)
        else {
            return super::StreamStart::Failed(full);
        };
        let content = body
            .pointer("/choices/0/message/content")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let id = body.get("id").cloned().unwrap_or_default();
        let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
            let c = json!({
                "id": id, "object": "chat.completion.chunk", "created": 0, "model": req.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
            });
            bytes::Bytes::from(format!("data: {c}\n\n"))
        };
        let mut chunks: Vec<bytes::Bytes> = vec![chunk(
            json!({"role": "assistant", "content": ""}),
            serde_json::Value::Null,
        )];
        for word in content.split_inclusive(' ') {
            chunks.push(chunk(json!({"content": word}), serde_json::Value::Null));
        }
        chunks.push(chunk(json!({}), json!("stop")));
        chunks.push(bytes::Bytes::from_static(b"data: [DONE]\n\n"));
        let first = chunks.remove(0);
        let rest = futures_util::stream::unfold(chunks.into_iter(), |mut it| async move {
            let next = it.next()?;
            tokio::time::sleep(Duration::from_millis(5)).await;
            Some((Ok(next), it))
        });
        super::StreamStart::Started {
            first,
            rest: Box::pin(rest),
            ttfb: full.latency,
            capacity: super::limits::Capacity::default(),
        }
    }

    fn answer(&self, req: UpstreamRequest<'_>) -> serde_json::Value {
        let question = crate::request::query_text(req.kind, req.body);
        match req.kind {
            InterfaceKind::Chat => {
                let content = format!(
                    "[{}] simulated answer to: {}",
                    self.id,
                    truncate(&question, 200)
                );
                let prompt_tokens = question.split_whitespace().count().max(1);
                let completion_tokens = content.split_whitespace().count();
                json!({
                    "id": format!("chatcmpl-sim-{:016x}", req.seed),
                    "object": "chat.completion",
                    "created": 0,
                    "model": req.model,
                    "choices": [{
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop"
                    }],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens
                    }
                })
            }
            InterfaceKind::Tool => json!({
                "provider": self.id,
                "query": question,
                "results": [
                    {"title": format!("{} result 1", self.id), "url": "https://example.invalid/1"},
                    {"title": format!("{} result 2", self.id), "url": "https://example.invalid/2"}
                ]
            }),
        }
    }
}

fn truncate(s: &str, max_chars: usize) -> String {
    s.chars().take(max_chars).collect()
}
