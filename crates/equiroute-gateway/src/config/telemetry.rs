//! The `[telemetry]` table: optional OpenTelemetry export of the gateway's traces over OTLP
//! (the gateway's `telemetry` module says what is exported and how it never holds a request up).

use serde::Deserialize;
use std::time::Duration;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    endpoint: Option<String>,
    protocol: Option<String>,
    sampling_ratio: Option<f64>,
    service_name: Option<String>,
    queue_size: Option<usize>,
    batch_size: Option<usize>,
    batch_delay_ms: Option<f64>,
    export_timeout_ms: Option<f64>,
}

/// Validated `[telemetry]`: where and how traces are exported.
#[derive(Clone, Debug, PartialEq)]
pub struct TelemetryConfig {
    /// The full URL spans are posted to (the endpoint with `/v1/traces` appended).
    pub traces_url: String,
    /// The fraction of requests whose traces are kept, in [0, 1].
    pub sampling_ratio: f64,
    /// `service.name` of the exported resource.
    pub service_name: String,
    /// Finished spans waiting for export at most; more are dropped and counted.
    pub queue_size: usize,
    /// Spans sent in one export request at most.
    pub batch_size: usize,
    /// How long a span waits at most before its batch is sent.
    pub batch_delay: Duration,
    /// How long one export request may take before it is abandoned.
    pub export_timeout: Duration,
}

/// The defaults, stated in docs/configuration.md.
const QUEUE_SIZE: usize = 2048;
const BATCH_SIZE: usize = 512;
const BATCH_DELAY_MS: f64 = 1000.0;
const EXPORT_TIMEOUT_MS: f64 = 5000.0;
/// The largest queue accepted: a span is about a kilobyte, so this is about 100 MB.
const MAX_QUEUE_SIZE: usize = 100_000;

/// Checks `[telemetry]`; problems are (field, fix).
pub(super) fn validate(raw: RawTelemetry) -> Result<TelemetryConfig, Vec<(String, String)>> {
    let mut problems = Vec::new();
    let mut problem = |field: &str, fix: String| problems.push((format!("telemetry.{field}"), fix));
    let traces_url = match raw.endpoint.as_deref().map(str::trim) {
        None | Some("") => {
            problem(
                "endpoint",
                "is required: the collector's OTLP/HTTP address, e.g. \"http://127.0.0.1:4318\" (remove [telemetry] to export nothing)".into(),
            );
            String::new()
        }
        Some(e)
            if e.split("://")
                .nth(1)
                .is_some_and(|rest| rest.split('/').next().is_some_and(|a| a.contains('@'))) =>
        {
            // The URL is logged at start-up: it must hold no secret.
            problem(
                "endpoint",
                "must not carry credentials (user:password@): point it at a collector or agent that needs none, e.g. one on loopback".into(),
            );
            String::new()
        }
        Some(e) => traces_url(e).unwrap_or_else(|| {
            problem(
                "endpoint",
                format!(
                    "`{e}` is not an http:// or https:// URL: write e.g. \"http://127.0.0.1:4318\""
                ),
            );
            String::new()
        }),
    };
    match raw.protocol.as_deref() {
        None | Some("http/protobuf") => {}
        Some(other) => problem(
            "protocol",
            format!("`{other}` is not supported: write \"http/protobuf\" (the only protocol built in; grpc and http/json are not)"),
        ),
    }
    let sampling_ratio = raw.sampling_ratio.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&sampling_ratio) {
        problem(
            "sampling_ratio",
            format!("must be between 0 and 1 (the fraction of requests traced; default 1), got {sampling_ratio}"),
        );
    }
    let service_name = raw.service_name.unwrap_or_else(|| "equiroute".into());
    if service_name.trim().is_empty() {
        problem(
            "service_name",
            "must not be empty (default \"equiroute\")".into(),
        );
    }
    let queue_size = raw.queue_size.unwrap_or(QUEUE_SIZE);
    if queue_size == 0 || queue_size > MAX_QUEUE_SIZE {
        problem(
            "queue_size",
            format!("must be between 1 and {MAX_QUEUE_SIZE} spans (default {QUEUE_SIZE}), got {queue_size}"),
        );
    }
    let batch_size = raw.batch_size.unwrap_or(BATCH_SIZE.min(queue_size));
    if batch_size == 0 || batch_size > queue_size {
        problem(
            "batch_size",
            format!("must be between 1 and queue_size ({queue_size}) (default {BATCH_SIZE}), got {batch_size}"),
        );
    }
    let mut millis = |field: &str, value: Option<f64>, default: f64| match value {
        None => Duration::from_secs_f64(default / 1000.0),
        Some(ms) if ms.is_finite() && ms > 0.0 && ms <= 60_000.0 => {
            Duration::from_secs_f64(ms / 1000.0)
        }
        Some(ms) => {
            problem(
                field,
                format!("must be a number of milliseconds above 0 and at most 60000 (default {default}), got {ms}"),
            );
            Duration::from_secs_f64(default / 1000.0)
        }
    };
    let batch_delay = millis("batch_delay_ms", raw.batch_delay_ms, BATCH_DELAY_MS);
    let export_timeout = millis(
        "export_timeout_ms",
        raw.export_timeout_ms,
        EXPORT_TIMEOUT_MS,
    );
    if problems.is_empty() {
        Ok(TelemetryConfig {
            traces_url,
            sampling_ratio,
            service_name,
            queue_size,
            batch_size,
            batch_delay,
            export_timeout,
        })
    } else {
        Err(problems)
    }
}

/// The traces URL of an OTLP/HTTP endpoint: `/v1/traces` appended to a base address, as the
/// OpenTelemetry SDKs do with `OTEL_EXPORTER_OTLP_ENDPOINT`; a URL already ending in it is
/// kept. `None` when it is not an http(s) URL.
fn traces_url(endpoint: &str) -> Option<String> {
    let uri: http::Uri = endpoint.parse().ok()?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.host().is_none() {
        return None;
    }
    let base = endpoint.trim_end_matches('/');
    if base.ends_with("/v1/traces") {
        Some(base.to_owned())
    } else {
        Some(format!("{base}/v1/traces"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(endpoint: &str) -> RawTelemetry {
        RawTelemetry {
            endpoint: Some(endpoint.into()),
            protocol: None,
            sampling_ratio: None,
            service_name: None,
            queue_size: None,
            batch_size: None,
            batch_delay_ms: None,
            export_timeout_ms: None,
        }
    }

    #[test]
    fn endpoint_gets_the_traces_path_once() {
        let c = validate(raw("http://127.0.0.1:4318")).unwrap();
        assert_eq!(c.traces_url, "http://127.0.0.1:4318/v1/traces");
        assert_eq!(c.queue_size, 2048);
        assert_eq!(c.batch_size, 512);
        assert_eq!(c.service_name, "equiroute");
        let c = validate(raw("https://otel.example/v1/traces/")).unwrap();
        assert_eq!(c.traces_url, "https://otel.example/v1/traces");
    }

    #[test]
    fn bad_fields_are_named() {
        let mut r = raw("127.0.0.1:4318");
        r.protocol = Some("grpc".into());
        r.sampling_ratio = Some(1.5);
        r.queue_size = Some(0);
        let fields: Vec<String> = validate(r).unwrap_err().into_iter().map(|p| p.0).collect();
        assert_eq!(
            fields,
            [
                "telemetry.endpoint",
                "telemetry.protocol",
                "telemetry.sampling_ratio",
                "telemetry.queue_size",
                "telemetry.batch_size"
            ]
        );
    }
}
