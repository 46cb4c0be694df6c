//! The `[state]` section: where learning state lives — an embedded file (one machine) or
//! Redis (several gateway instances sharing their statistics).

use super::secrets::Secret;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

/// Where state is kept and how often it is saved.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    pub path: PathBuf,
    /// Seconds between snapshots (also saved on shutdown).
    #[serde(default = "default_interval")]
    pub snapshot_interval_s: f64,
}

fn default_interval() -> f64 {
    5.0
}

/// Bytes of log entries between two compactions by default (8 MiB).
const DEFAULT_COMPACT_BYTES: u64 = 8 << 20;

/// `[state]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawState {
    backend: Option<String>,
    path: Option<PathBuf>,
    snapshot_interval_s: Option<f64>,
    url: Option<String>,
    url_env: Option<String>,
    namespace: Option<String>,
    sync_interval_ms: Option<f64>,
    compact_every: Option<u64>,
    compact_bytes: Option<u64>,
    max_unpushed: Option<usize>,
    claim_timeout_ms: Option<f64>,
    username: Option<String>,
    password_env: Option<String>,
    tls_ca_file: Option<PathBuf>,
}

/// Where learning state lives, validated.
#[derive(Clone, Debug, PartialEq)]
pub enum StateConfig {
    /// One snapshot in an embedded redb file.
    File(StoreConfig),
    /// Shared with other instances through Redis.
    Redis(RedisStateConfig),
}

/// `[state] backend = "redis"`.
#[derive(Clone, Debug, PartialEq)]
pub struct RedisStateConfig {
    /// `redis://host:port[/db]` or `rediss://` (TLS), possibly with a password: never printed.
    pub url: Secret,
    /// The ACL user name (`AUTH user password`), when not in the URL.
    pub username: Option<String>,
    /// The password, read from the variable `password_env` names, when not in the URL.
    pub password: Option<Secret>,
    /// The CA certificate (PEM) a `rediss://` server's certificate is checked against, for a
    /// private CA; none: the system's trusted roots.
    pub tls_ca_file: Option<PathBuf>,
    /// Prefix of every key, so that several deployments can share one Redis.
    pub namespace: String,
    /// How often each instance pushes its observations and pulls the others'.
    pub sync_interval: Duration,
    /// Log entries between two compactions (a snapshot of the merged state, older entries
    /// trimmed).
    pub compact_every: u64,
    /// Bytes of log entries between two compactions, whichever of the two comes first: the
    /// log's memory in Redis stays under about twice this (the entries since the previous
    /// snapshot are kept for instances that fall behind), however busy the instances are.
    pub compact_bytes: u64,
    /// Most observations kept for Redis while it is unreachable; beyond, the oldest are
    /// dropped and counted.
    pub max_unpushed: usize,
    /// Longest wait of `POST /v1/feedback` for its claim of the request id in Redis; beyond,
    /// the score is applied locally (and counted once when the instances sync).
    pub claim_timeout: Duration,
}

/// Validates `[state]`; problems are (field, fix) pairs.
pub(super) fn validate(
    raw: RawState,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<StateConfig, Vec<(String, String)>> {
    let mut problems = Vec::new();
    let mut bad = |field: &str, fix: String| problems.push((format!("state.{field}"), fix));
    let config = match raw.backend.as_deref().unwrap_or("file") {
        "file" => file(raw, &mut bad),
        "redis" => redis(raw, env, &mut bad),
        other => {
            bad(
                "backend",
                format!("`{other}` is not a backend: use \"file\" or \"redis\""),
            );
            None
        }
    };
    match config {
        Some(c) if problems.is_empty() => Ok(c),
        _ => Err(problems),
    }
}

/// Reports a field that the chosen backend does not use.
fn misplaced(backend: &str, name: &str, present: bool, bad: &mut dyn FnMut(&str, String)) {
    if present {
        bad(
            name,
            format!("is not used with backend = \"{backend}\": remove it"),
        );
    }
}

fn file(raw: RawState, bad: &mut dyn FnMut(&str, String)) -> Option<StateConfig> {
    misplaced("file", "url", raw.url.is_some(), bad);
    misplaced("file", "url_env", raw.url_env.is_some(), bad);
    misplaced("file", "namespace", raw.namespace.is_some(), bad);
    misplaced(
        "file",
        "sync_interval_ms",
        raw.sync_interval_ms.is_some(),
        bad,
    );
    misplaced("file", "compact_every", raw.compact_every.is_some(), bad);
    misplaced("file", "compact_bytes", raw.compact_bytes.is_some(), bad);
    misplaced("file", "max_unpushed", raw.max_unpushed.is_some(), bad);
    misplaced(
        "file",
        "claim_timeout_ms",
        raw.claim_timeout_ms.is_some(),
        bad,
    );
    misplaced("file", "username", raw.username.is_some(), bad);
    misplaced("file", "password_env", raw.password_env.is_some(), bad);
    misplaced("file", "tls_ca_file", raw.tls_ca_file.is_some(), bad);
    let interval = raw.snapshot_interval_s.unwrap_or(5.0);
    if !(interval.is_finite() && interval > 0.0) {
        bad(
            "snapshot_interval_s",
            "must be a positive number of seconds, e.g. 5".into(),
        );
    }
    if let Some(path) = raw.path {
        Some(StateConfig::File(StoreConfig {
            path,
            snapshot_interval_s: interval,
        }))
    } else {
        bad(
            "path",
            "the file backend needs a file: add path = \"equiroute-state.redb\"".into(),
        );
        None
    }
}

fn redis(
    raw: RawState,
    env: &dyn Fn(&str) -> Option<String>,
    bad: &mut dyn FnMut(&str, String),
) -> Option<StateConfig> {
    misplaced("redis", "path", raw.path.is_some(), bad);
    misplaced(
        "redis",
        "snapshot_interval_s",
        raw.snapshot_interval_s.is_some(),
        bad,
    );
    let url = redis_url(raw.url, raw.url_env, env, bad);
    let (username, password, tls_ca_file) = credentials(
        url.as_deref(),
        raw.username,
        raw.password_env,
        raw.tls_ca_file,
        env,
        bad,
    );
    let namespace = raw.namespace.unwrap_or_else(|| "equiroute".to_owned());
    if namespace.is_empty()
        || !namespace
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c))
    {
        bad(
            "namespace",
            "use letters, digits and - _ . : only, e.g. \"equiroute-prod\"".into(),
        );
    }
    let sync_ms = raw.sync_interval_ms.unwrap_or(500.0);
    if !(sync_ms.is_finite() && (10.0..=60_000.0).contains(&sync_ms)) {
        bad(
            "sync_interval_ms",
            "must be between 10 and 60000 milliseconds (default 500)".into(),
        );
    }
    let (compact_every, compact_bytes) = compaction(raw.compact_every, raw.compact_bytes, bad);
    let max_unpushed = raw.max_unpushed.unwrap_or(200_000);
    if max_unpushed < 1000 {
        bad(
            "max_unpushed",
            "must be at least 1000 observations (default 200000)".into(),
        );
    }
    let claim_ms = raw.claim_timeout_ms.unwrap_or(20.0);
    if !(claim_ms.is_finite() && (1.0..=1000.0).contains(&claim_ms)) {
        bad(
            "claim_timeout_ms",
            "must be between 1 and 1000 milliseconds (default 20)".into(),
        );
    }
    url.map(|url| {
        StateConfig::Redis(RedisStateConfig {
            url: Secret(url),
            username,
            password,
            tls_ca_file,
            namespace,
            sync_interval: Duration::from_secs_f64(sync_ms / 1000.0),
            compact_every,
            compact_bytes,
            max_unpushed,
            claim_timeout: Duration::from_secs_f64(claim_ms / 1000.0),
        })
    })
}

/// The URL of `url` or of the variable `url_env` names: one of the two, without a password
/// written in the file, `redis://` or `rediss://`.
fn redis_url(
    url: Option<String>,
    url_env: Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
    bad: &mut dyn FnMut(&str, String),
) -> Option<String> {
    let from_env = url_env.is_some();
    let url = match (url, url_env) {
        (Some(_), Some(_)) => {
            bad("url", "give url or url_env, not both".into());
            None
        }
        (Some(url), None) => {
            if has_password(&url) {
                bad("url", "contains a password: put the URL in an environment variable and name it in state.url_env".into());
                None
            } else {
                Some(url)
            }
        }
        (None, Some(name)) => {
            let unset = "export it with a redis:// or rediss:// URL";
            match super::secrets::env_secret(&name, "REDIS_URL", unset, env) {
                Ok(url) => Some(url.0),
                Err(fix) => {
                    bad("url_env", fix);
                    None
                }
            }
        }
        (None, None) => {
            bad(
                "url",
                "the redis backend needs an address: add url = \"redis://127.0.0.1:6379\" (or url_env naming a variable that holds it)".into(),
            );
            None
        }
    };
    if let Some(u) = &url {
        if !u.starts_with("redis://") && !u.starts_with("rediss://") {
            bad(
                if from_env { "url_env" } else { "url" },
                "must be a redis:// URL, e.g. redis://127.0.0.1:6379/0, or rediss:// for TLS"
                    .into(),
            );
        }
    }
    url
}

/// `username`, `password_env` (read) and `tls_ca_file` (checked to hold a certificate), for
/// `url` (a password is in the URL or in `password_env`, not both; a CA file needs TLS).
fn credentials(
    url: Option<&str>,
    username: Option<String>,
    password_env: Option<String>,
    tls_ca_file: Option<PathBuf>,
    env: &dyn Fn(&str) -> Option<String>,
    bad: &mut dyn FnMut(&str, String),
) -> (Option<String>, Option<Secret>, Option<PathBuf>) {
    if username
        .as_deref()
        .is_some_and(|u| u.is_empty() || u.chars().any(|c| c.is_whitespace() || c.is_control()))
    {
        bad(
            "username",
            "must be an ACL user name without spaces, e.g. \"equiroute\"".into(),
        );
    }
    let password = password_env.and_then(|name| {
        if url.is_some_and(has_password) {
            bad(
                "password_env",
                "the URL holds a password already: give it in one place".into(),
            );
            return None;
        }
        let unset = "export it with the Redis user's password";
        super::secrets::env_secret(&name, "EQUIROUTE_REDIS_PASSWORD", unset, env)
            .map_err(|fix| bad("password_env", fix))
            .ok()
    });
    if username.is_some() && password.is_none() && !url.is_some_and(has_password) {
        bad(
            "username",
            "a user needs its password: add password_env = \"EQUIROUTE_REDIS_PASSWORD\" naming a variable that holds it".into(),
        );
    }
    let tls_ca_file = tls_ca_file.filter(|path| {
        if !url.is_some_and(|u| u.starts_with("rediss://")) {
            bad(
                "tls_ca_file",
                "is used with a rediss:// URL only (TLS): use rediss://, or remove it".into(),
            );
            return false;
        }
        super::tls::read_ca(path)
            .map_err(|fix| bad("tls_ca_file", fix))
            .is_ok()
    });
    (username, password, tls_ca_file)
}

/// `compact_every` and `compact_bytes`, checked: the log is compacted after whichever of the
/// two comes first.
fn compaction(
    every: Option<u64>,
    bytes: Option<u64>,
    bad: &mut dyn FnMut(&str, String),
) -> (u64, u64) {
    let compact_every = every.unwrap_or(20_000);
    if compact_every < 100 {
        bad(
            "compact_every",
            "must be at least 100 log entries (default 20000)".into(),
        );
    }
    let compact_bytes = bytes.unwrap_or(DEFAULT_COMPACT_BYTES);
    if compact_bytes < 65_536 {
        bad(
            "compact_bytes",
            format!("must be at least 65536 bytes (default {DEFAULT_COMPACT_BYTES}, 8 MiB)"),
        );
    }
    (compact_every, compact_bytes)
}

/// The state file of a gateway started without a configuration: `equiroute/default.redb` in
/// the user's state directory, `$XDG_STATE_HOME` (when set to an absolute path, as the XDG
/// base directory specification asks) or else `$HOME/.local/state`. `None` when neither is
/// set: learning then stays in memory.
#[must_use]
pub fn default_state_file(env: &dyn Fn(&str) -> Option<String>) -> Option<StateConfig> {
    let absolute = |name: &str| env(name).map(PathBuf::from).filter(|p| p.is_absolute());
    let dir = absolute("XDG_STATE_HOME")
        .or_else(|| absolute("HOME").map(|home| home.join(".local").join("state")))?;
    Some(StateConfig::File(StoreConfig {
        path: dir.join("equiroute").join("default.redb"),
        snapshot_interval_s: 5.0,
    }))
}

/// Whether a redis:// URL carries a password (`redis://user:pass@host` or `redis://:pass@host`).
fn has_password(url: &str) -> bool {
    url_password(url).is_some()
}

/// The password in `url`'s user information (`redis://user:password@host`), if any.
pub(super) fn url_password(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or("");
    let (userinfo, _) = authority.rsplit_once('@')?;
    userinfo.split_once(':').map(|(_, password)| password)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(
        text: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<StateConfig, Vec<(String, String)>> {
        let raw: RawState =
            toml::from_str(text).map_err(|e| vec![("syntax".into(), e.to_string())])?;
        validate(raw, env)
    }

    #[test]
    fn redis_backend_reads_the_url_from_the_environment_and_never_accepts_a_literal_password() {
        let env = |k: &str| (k == "R").then(|| "redis://:hunter2@127.0.0.1:7000/1".to_owned());
        let Ok(StateConfig::Redis(r)) = parse("backend = \"redis\"\nurl_env = \"R\"", &env) else {
            panic!("redis config refused");
        };
        assert_eq!(r.namespace, "equiroute");
        assert_eq!(r.sync_interval, Duration::from_millis(500));
        assert_eq!(r.claim_timeout, Duration::from_millis(20));
        let e = parse("backend = \"redis\"\nurl = \"redis://:hunter2@h:1\"", &env).unwrap_err();
        assert_eq!(e[0].0, "state.url");
        assert!(e[0].1.contains("url_env") && !e[0].1.contains("hunter2"));
        let e = parse("backend = \"redis\"\nurl_env = \"MISSING\"", &env).unwrap_err();
        assert!(e[0].0 == "state.url_env" && e[0].1.contains("MISSING"));
    }

    #[test]
    fn every_misplaced_or_out_of_range_field_is_named() {
        let none = |_: &str| None;
        let e = parse(
            "backend = \"redis\"\nurl = \"redis://127.0.0.1:1\"\npath = \"x\"\nsync_interval_ms = 5\nnamespace = \"a b\"\nclaim_timeout_ms = 0",
            &none,
        )
        .unwrap_err();
        let fields: Vec<&str> = e.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(
            fields,
            [
                "state.path",
                "state.namespace",
                "state.sync_interval_ms",
                "state.claim_timeout_ms"
            ]
        );
        let e = parse("path = \"s.redb\"\nclaim_timeout_ms = 20", &none).unwrap_err();
        assert_eq!(e[0].0, "state.claim_timeout_ms");
        let e = parse("path = \"s.redb\"\ncompact_bytes = 100000", &none).unwrap_err();
        assert_eq!(e[0].0, "state.compact_bytes");
        let e = parse(
            "backend = \"redis\"\nurl = \"redis://h:1\"\ncompact_bytes = 1000",
            &none,
        )
        .unwrap_err();
        assert!(e[0].0 == "state.compact_bytes" && e[0].1.contains("65536"));
        let e = parse("backend = \"memcached\"", &none).unwrap_err();
        assert!(e[0].0 == "state.backend" && e[0].1.contains("\"redis\""));
        let e = parse("url = \"redis://h:1\"", &none).unwrap_err();
        assert_eq!(e[0].0, "state.url");
        assert!(matches!(
            parse("path = \"s.redb\"", &none),
            Ok(StateConfig::File(_))
        ));
    }

    #[test]
    fn the_default_state_file_is_in_the_users_state_directory() {
        let path = |vars: &[(&str, &str)]| {
            let env = |k: &str| {
                vars.iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| (*v).to_owned())
            };
            match default_state_file(&env) {
                Some(StateConfig::File(f)) => Some(f.path),
                _ => None,
            }
        };
        assert_eq!(
            path(&[("XDG_STATE_HOME", "/x/state"), ("HOME", "/home/u")]),
            Some(PathBuf::from("/x/state/equiroute/default.redb"))
        );
        assert_eq!(
            path(&[("HOME", "/home/u")]),
            Some(PathBuf::from("/home/u/.local/state/equiroute/default.redb"))
        );
        // A relative or empty XDG_STATE_HOME is ignored, as the specification asks.
        assert_eq!(
            path(&[("XDG_STATE_HOME", "rel"), ("HOME", "/home/u")]),
            Some(PathBuf::from("/home/u/.local/state/equiroute/default.redb"))
        );
        assert_eq!(path(&[("XDG_STATE_HOME", ""), ("HOME", "")]), None);
        assert_eq!(path(&[]), None);
    }

    #[test]
    fn rediss_urls_take_a_user_and_a_password_from_the_environment() {
        let env = |k: &str| (k == "PW").then(|| "s3cret-value".to_owned());
        let text = "backend = \"redis\"\nurl = \"rediss://cache.example.com:6380/0\"\nusername = \"equiroute\"\npassword_env = \"PW\"";
        let Ok(StateConfig::Redis(r)) = parse(text, &env) else {
            panic!("rediss config refused");
        };
        assert_eq!(r.username.as_deref(), Some("equiroute"));
        assert_eq!(r.password, Some(Secret("s3cret-value".into())));
        assert_eq!(r.tls_ca_file, None);
        // A user without a password, a password given twice, a CA file without TLS.
        let cases = [
            (
                "url = \"rediss://h:1\"\nusername = \"u\"",
                "state.username",
                "password_env",
            ),
            (
                "url_env = \"U\"\npassword_env = \"PW\"",
                "state.password_env",
                "one place",
            ),
            (
                "url = \"redis://h:1\"\ntls_ca_file = \"ca.pem\"",
                "state.tls_ca_file",
                "rediss://",
            ),
            (
                "url = \"rediss://h:1\"\ntls_ca_file = \"/no/such/ca.pem\"",
                "state.tls_ca_file",
                "does not exist",
            ),
            (
                "url = \"rediss://h:1\"\npassword_env = \"UNSET\"",
                "state.password_env",
                "UNSET",
            ),
            ("url = \"http://h:1\"", "state.url", "rediss://"),
        ];
        let env = |k: &str| match k {
            "PW" => Some("s3cret-value".to_owned()),
            "U" => Some("rediss://:other-secret@h:1".to_owned()),
            _ => None,
        };
        for (lines, field, fix) in cases {
            let e = parse(&format!("backend = \"redis\"\n{lines}"), &env).unwrap_err();
            assert_eq!(e[0].0, field, "{lines}");
            assert!(e[0].1.contains(fix), "{lines}: {}", e[0].1);
            assert!(!e[0].1.contains("s3cret-value") && !e[0].1.contains("other-secret"));
        }
        let e = parse("path = \"s.redb\"\npassword_env = \"PW\"", &env).unwrap_err();
        assert_eq!(e[0].0, "state.password_env");
    }

    #[test]
    fn passwords_are_found_in_the_userinfo_only() {
        assert!(has_password("redis://u:p@h:1/0"));
        assert!(has_password("redis://:p@h:1"));
        assert!(!has_password("redis://h:1/0"));
        assert!(!has_password("redis://user@h:1"));
    }
}
