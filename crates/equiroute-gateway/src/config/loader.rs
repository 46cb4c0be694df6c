//! Loading a configuration: the TOML read into the raw tables (every problem of its shape at
//! once), then each section checked ([`load_all`]), and [`load`] for the first problem only.

use super::defaults::{DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_GRACE};
use super::interfaces::{load_interface, RawInterface};
use super::problems::{gateway_policies, unechoed, ConfigError};
use super::server::{
    connection_limits, listen_address, log_format, server_keys, shutdown_grace, RawServer,
};
use super::types::{AuditConfig, ConnectionLimits, GatewayConfig};
use super::{state, telemetry, tls};
use equiroute_core::Millis;
use serde::Deserialize;
use std::collections::BTreeMap;

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
    let tls = validated(raw.server.tls.take(), tls::validate, &err, &mut problems);
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
            tls,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{no_env, LogFormat, DEFAULT_CONFIG};
    use equiroute_core::breaker::BreakerConfig;
    use std::time::Duration;

    #[test]
    fn the_embedded_default_loads() {
        let cfg = load(DEFAULT_CONFIG, "default", &no_env).unwrap();
        assert!(cfg.interfaces.len() >= 2);
        assert!(cfg.listen.ip().is_loopback());
        assert_eq!(cfg.warnings, []);
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
}
