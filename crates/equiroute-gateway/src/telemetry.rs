//! OpenTelemetry export of the gateway's spans (`[telemetry]`): the `request`, `decision` and
//! `attempt` spans of `server::execute` (and the feedback, snapshot and Redis sync spans)
//! become OTLP spans posted over HTTP/protobuf to a collector.
//!
//! Nothing here can hold a request up: a finished span goes into a bounded queue with a
//! non-blocking `try_send` (a full queue drops it and counts it in
//! [`spans_dropped`]), and one task on the runtime batches the queue and posts it, each post
//! abandoned after the export timeout. Failures are counted and logged at most once a
//! minute. Only spans are exported, never log events: the span fields are ids, names,
//! numbers and outcomes, never a prompt, an answer or a key.

use crate::config::TelemetryConfig;
use bytes::Bytes;
use http_body_util::Full;
use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::{SpanContext, TraceContextExt as _, TracerProvider as _};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    Sampler, SdkTracer, SdkTracerProvider, SpanData, SpanExporter as _, SpanProcessor,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tracing_subscriber::filter::{FilterFn, Filtered};

static SPANS_DROPPED: AtomicU64 = AtomicU64::new(0);
static EXPORTING: AtomicBool = AtomicBool::new(false);
static EXPORT_FAILURES: AtomicU64 = AtomicU64::new(0);
static SPANS_EXPORTED: AtomicU64 = AtomicU64::new(0);

/// Whether an export pipeline was started in this process: the request span's closing
/// attributes are recorded only then (the logs do not show them, and recording a field on a
/// span the log formatter holds costs it a string).
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// The client's span from the W3C `traceparent` (and `tracestate`) headers, when traces are
/// exported; a missing or malformed header is no parent, never an error.
pub fn remote_parent(headers: &http::HeaderMap) -> Option<SpanContext> {
    if !exporting() {
        return None;
    }
    let traceparent = headers.get("traceparent")?.to_str().ok()?;
    if !well_formed(traceparent) {
        return None;
    }
    let cx = TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers));
    let parent = cx.span().span_context().clone();
    parent.is_valid().then_some(parent)
}

/// Whether `traceparent` has W3C's shape: `version-trace_id-parent_id-flags`, of 2, 32, 16 and
/// 2 lowercase hex digits (the propagator alone accepts shorter ids).
fn well_formed(traceparent: &str) -> bool {
    let mut parts = traceparent.trim().split('-');
    [2, 32, 16, 2].into_iter().all(|n| {
        parts.next().is_some_and(|p| {
            p.len() == n
                && p.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
    })
}

/// Spans dropped because the export queue was full, since the process started.
pub fn spans_dropped() -> u64 {
    SPANS_DROPPED.load(Ordering::Relaxed)
}

/// Export requests that failed or timed out, since the process started.
pub fn export_failures() -> u64 {
    EXPORT_FAILURES.load(Ordering::Relaxed)
}

/// Spans the collector accepted, since the process started.
pub fn spans_exported() -> u64 {
    SPANS_EXPORTED.load(Ordering::Relaxed)
}

/// A running export pipeline; [`Telemetry::shutdown`] (or dropping it) ends the export task
/// after it sent what was queued.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

/// The layer that turns the gateway's spans into OpenTelemetry spans: spans of the
/// `equiroute*` targets only, no events (they may quote a provider's error text).
pub type Layer<S> = Filtered<
    tracing_opentelemetry::OpenTelemetryLayer<S, SdkTracer>,
    FilterFn<fn(&tracing::Metadata<'_>) -> bool>,
    S,
>;

impl Telemetry {
    /// Starts the export task on `runtime`.
    ///
    /// # Errors
    /// The exporter cannot be built from the configuration (the message names no secret).
    pub fn start(
        config: &TelemetryConfig,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Telemetry, String> {
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(config.service_name.clone())
            .build();
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(OtlpClient {
                timeout: config.export_timeout,
            })
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(config.traces_url.clone())
            .with_timeout(config.export_timeout)
            .build()
            .map_err(|e| format!("telemetry.endpoint: cannot build the OTLP exporter: {e}"))?;
        // The processor hands spans to the task, not to the exporter: the resource goes here.
        exporter.set_resource(&resource);
        let (sender, queue) = mpsc::channel(config.queue_size);
        let batching = Batching {
            size: config.batch_size,
            delay: config.batch_delay,
            timeout: config.export_timeout,
        };
        runtime.spawn(export_loop(queue, exporter, batching));
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sampling_ratio,
            ))))
            .with_resource(resource)
            .with_span_processor(QueueProcessor { sender })
            .build();
        let tracer = provider.tracer("equiroute");
        EXPORTING.store(true, Ordering::Relaxed);
        Ok(Telemetry { provider, tracer })
    }

    /// The `tracing` layer exporting the gateway's spans through this pipeline.
    pub fn layer<S>(&self) -> Layer<S>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        use tracing_subscriber::Layer as _;
        let spans_only: fn(&tracing::Metadata<'_>) -> bool =
            |m| m.is_span() && m.target().starts_with("equiroute");
        tracing_opentelemetry::layer()
            .with_tracer(self.tracer.clone())
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_level(false)
            .with_filter(FilterFn::new(spans_only))
    }

    /// Stops taking spans; the export task sends what is queued and ends.
    pub fn shutdown(self) {
        let _ = self.provider.shutdown();
    }
}

/// The span processor: finished sampled spans into the bounded queue, never waiting.
#[derive(Debug)]
struct QueueProcessor {
    sender: mpsc::Sender<SpanData>,
}

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.sender.try_send(span).is_err() {
            SPANS_DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        // The export task ends when the provider (and with it this sender) is dropped.
        Ok(())
    }
}

#[derive(Clone, Copy)]
struct Batching {
    size: usize,
    delay: Duration,
    timeout: Duration,
}

/// Collects up to `size` spans or for `delay` after the first, posts them, and again, until
/// every sender is gone.
async fn export_loop(
    mut queue: mpsc::Receiver<SpanData>,
    exporter: opentelemetry_otlp::SpanExporter,
    batching: Batching,
) {
    let mut last_logged: Option<tokio::time::Instant> = None;
    while let Some(first) = queue.recv().await {
        let mut batch = Vec::with_capacity(batching.size);
        batch.push(first);
        let until = tokio::time::Instant::now() + batching.delay;
        while batch.len() < batching.size {
            match tokio::time::timeout_at(until, queue.recv()).await {
                Ok(Some(span)) => batch.push(span),
                Ok(None) | Err(_) => break,
            }
        }
        let count = batch.len() as u64;
        let outcome = tokio::time::timeout(batching.timeout, exporter.export(batch)).await;
        let failure = match outcome {
            Ok(Ok(())) => {
                SPANS_EXPORTED.fetch_add(count, Ordering::Relaxed);
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {} ms", batching.timeout.as_millis()),
        };
        EXPORT_FAILURES.fetch_add(1, Ordering::Relaxed);
        // A dead collector fails every batch: one line a minute is enough to say so.
        let now = tokio::time::Instant::now();
        if last_logged.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(60)) {
            last_logged = Some(now);
            tracing::warn!(
                spans = count,
                failures = export_failures(),
                error = %failure,
                "trace export failed; its spans are dropped (logged at most once a minute)"
            );
        }
    }
}

/// The exporter's HTTP client: the gateway's own pooled hyper client over rustls (no second
/// HTTP or TLS stack), with the export timeout on the whole exchange.
#[derive(Debug)]
struct OtlpClient {
    timeout: Duration,
}

type HttpResult = Result<http::Response<Bytes>, opentelemetry_http::HttpError>;

impl opentelemetry_http::HttpClient for OtlpClient {
    // What `#[async_trait]` expands to, written out to spare the dependency.
    fn send_bytes<'client, 'future>(
        &'client self,
        request: http::Request<Bytes>,
    ) -> Pin<Box<dyn Future<Output = HttpResult> + Send + 'future>>
    where
        'client: 'future,
        Self: 'future,
    {
        Box::pin(async move {
            let exchange = async {
                let reply = crate::upstream::client::HttpClient::new()
                    .send(request.map(Full::new))
                    .await?;
                let (head, body) = reply.into_parts();
                let body = crate::upstream::client::read_body(body).await?;
                Ok::<_, String>(http::Response::from_parts(head, body))
            };
            match tokio::time::timeout(self.timeout, exchange).await {
                Ok(Ok(response)) => Ok(response),
                Ok(Err(e)) => Err(e.into()),
                Err(_) => Err("timed out".into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::well_formed;

    #[test]
    fn a_traceparent_needs_four_lowercase_hex_parts_of_w3c_lengths() {
        let id = "0af7651916cd43dd8448eb211c80319c";
        assert!(well_formed(&format!("00-{id}-b7ad6b7169203331-01")));
        // A later version may append fields after the four.
        assert!(well_formed(&format!("01-{id}-b7ad6b7169203331-01-extra")));
        for bad in [
            String::new(),
            format!("00-{id}-b7ad6b7169203331"),
            format!("00-{id}-b7ad6b716920333-01"),
            format!("00-{}-b7ad6b7169203331-01", id.to_uppercase()),
            format!("0-{id}-b7ad6b7169203331-01"),
            format!("00-{id}-b7ad6b7169203331-0g"),
        ] {
            assert!(!well_formed(&bad), "{bad}");
        }
    }
}
