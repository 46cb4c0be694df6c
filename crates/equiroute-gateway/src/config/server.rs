//! The `[server]` table: its raw fields and their checks (the listen address, keys, connection
//! limits, log format, shutdown grace).

use super::defaults::{
    DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_HEADER_BYTES, DEFAULT_SHUTDOWN_GRACE,
    MAX_CONNECTION_TIMEOUT_MS, MAX_MAX_HEADER_BYTES, MIN_MAX_HEADER_BYTES,
};
use super::keys;
use super::problems::ConfigError;
use super::types::{ConnectionLimits, LogFormat};
use serde::Deserialize;
use std::net::SocketAddr;
use std::time::Duration;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: Option<String>,
    pub(super) max_body_bytes: Option<usize>,
    /// Names of environment variables holding accepted bearer keys.
    #[serde(default)]
    pub(super) api_keys_env: Vec<String>,
    /// Names of environment variables holding the keys of the state routes.
    #[serde(default)]
    pub(super) admin_keys_env: Vec<String>,
    /// Keys with a tenant, task classes and a role (`[[server.keys]]`).
    #[serde(default)]
    pub(super) keys: Vec<keys::RawKey>,
    /// Most feedback scores one key may post per second (a token bucket); none: no cap.
    pub(super) feedback_rate_per_key: Option<f64>,
    /// Scores one key may post at once after a quiet spell; default twice the rate.
    pub(super) feedback_burst_per_key: Option<f64>,
    /// How long a request's context waits for quality feedback, in seconds.
    pub(super) feedback_ttl_s: Option<f64>,
    /// Most contexts kept for feedback at once.
    pub(super) max_pending_feedback: Option<usize>,
    /// Threads serving requests; none: one per core.
    pub(super) worker_threads: Option<usize>,
    /// Longest wait for a request's headers, from the accept or the first byte after idling.
    pub(super) header_read_timeout_ms: Option<f64>,
    /// Longest wait for a request's whole body, from its headers.
    pub(super) body_read_timeout_ms: Option<f64>,
    /// Longest a keep-alive connection stays open with no request in flight.
    pub(super) idle_timeout_ms: Option<f64>,
    /// Longest a response write may wait for a client that does not read.
    pub(super) send_timeout_ms: Option<f64>,
    /// Most client connections open at once, across every event loop.
    pub(super) max_connections: Option<usize>,
    /// Most connections one client address holds at once.
    pub(super) max_connections_per_address: Option<usize>,
    /// Largest request head (request line and headers), in bytes.
    pub(super) max_header_bytes: Option<usize>,
    /// Most bytes of request bodies still arriving, over every connection.
    pub(super) max_buffered_bytes: Option<usize>,
    /// Most of those one client address holds.
    pub(super) max_buffered_bytes_per_address: Option<usize>,
    /// Most requests one gateway key has in flight at once.
    pub(super) max_in_flight_per_key: Option<usize>,
    /// `human` (default) or `json` (one JSON object per line) for the logs on stderr.
    pub(super) log_format: Option<String>,
    /// Longest drain after a stop signal before the streams still open are ended.
    pub(super) shutdown_grace_ms: Option<f64>,
    /// HTTPS: the certificate chain and key (`[server.tls]`); none: plain HTTP.
    pub(super) tls: Option<super::tls::RawTls>,
}

/// `server.shutdown_grace_ms`, or the problem with it as (field, fix).
pub(super) fn shutdown_grace(raw: &RawServer) -> Result<Duration, (String, String)> {
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

/// The `[server]` connection limits, or the problems with them as (field, fix).
/// `max_body_bytes` is the largest body, which the buffered-bytes limits must hold.
pub(super) fn connection_limits(
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

/// `server.log_format`: `human` (the default) or `json`; anything else is a problem.
pub(super) fn log_format(
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

/// The gateway's keys and feedback rate, read from `server`'s key lists and tables (taken).
pub(super) fn server_keys(
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

/// `server.listen` as an address: an IP address and port, or `localhost:PORT` (read as
/// 127.0.0.1:PORT); the fix otherwise.
pub(super) fn listen_address(text: &str) -> Result<SocketAddr, String> {
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

#[cfg(test)]
mod tests {
    use crate::config::{load, no_env};

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
}
