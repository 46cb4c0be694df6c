//! The keys the gateway accepts and what each may do: `server.api_keys_env` (client keys),
//! `server.admin_keys_env` (admin keys) and `[[server.keys]]` tables, which bind a key to a
//! tenant, to task classes and to a role. Every key gets a label (its `name`, else the name
//! of the environment variable that holds it): the label, never the key, is what requests,
//! pending feedback, logs and the audit log carry. Also the per-key feedback rate.

use super::secrets::Secret;
use serde::Deserialize;
use std::sync::Arc;

/// One `[[server.keys]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKey {
    /// The environment variable holding the key.
    env: String,
    /// The key's label; default: `env`.
    name: Option<String>,
    /// The tenant every request with this key is for (the header cannot change it).
    tenant: Option<String>,
    /// The task classes this key may name in `x-equiroute-task-class`; absent: any.
    task_classes: Option<Vec<String>>,
    #[serde(default)]
    role: KeyRole,
}

/// What a key may do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyRole {
    /// The traffic routes, and feedback on the requests made with this key.
    #[default]
    Client,
    /// A client key that may also score any request (an external judge, a labelling tool).
    Judge,
    /// The state and rollout routes and the dashboard, and feedback on any request; not the
    /// traffic routes.
    Admin,
}

impl KeyRole {
    /// Whether the key may score requests made with other keys.
    #[must_use]
    pub fn scores_any_request(self) -> bool {
        matches!(self, KeyRole::Judge | KeyRole::Admin)
    }

    /// Whether the key opens the traffic routes (`/v1/chat/completions`, `/v1/tools/…`,
    /// `/v1/models`).
    #[must_use]
    pub fn sends_traffic(self) -> bool {
        matches!(self, KeyRole::Client | KeyRole::Judge)
    }
}

/// What a key may do, without the key: safe to log, to store and to share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyGrant {
    /// The key's label: its `name`, else the name of its environment variable. Unique. Shared,
    /// so that every request it makes carries it without a copy.
    pub label: Arc<str>,
    pub role: KeyRole,
    /// The tenant of every request made with the key.
    pub tenant: Option<String>,
    /// The task classes the key may name; `None`: any.
    pub task_classes: Option<Vec<String>>,
}

/// An accepted key and its grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyConfig {
    pub secret: Secret,
    pub grant: KeyGrant,
}

/// The cap on one key's feedback (`server.feedback_rate_per_key`), a token bucket.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FeedbackRate {
    /// Scores per second, sustained.
    pub per_second: f64,
    /// Scores accepted at once after a quiet spell.
    pub burst: f64,
}

/// The longest label and tenant name accepted.
const MAX_NAME: usize = 128;

/// Whether `name` can be a tenant: 1 to 128 visible ASCII characters (what an HTTP header
/// carries, trimmed). A configured name that is not could never be matched by a request.
#[must_use]
pub fn valid_tenant(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME && name.bytes().all(|b| b.is_ascii_graphic())
}

/// The fix for a tenant name that is not one.
pub const TENANT_FIX: &str = "a tenant name is 1 to 128 visible ASCII characters (letters, digits, punctuation; no spaces), as the `x-equiroute-tenant` header carries it";

/// A label: 1 to 128 letters, digits, `_`, `-` or `.`.
fn valid_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// The `[server]` settings this module reads.
pub(super) struct RawKeys<'a> {
    pub api_keys_env: &'a [String],
    pub admin_keys_env: &'a [String],
    pub keys: Vec<RawKey>,
    pub feedback_rate_per_key: Option<f64>,
    pub feedback_burst_per_key: Option<f64>,
}

/// The keys, and the cap on each one's feedback.
pub(super) type Validated = (Vec<KeyConfig>, Option<FeedbackRate>);

/// A key read so far, with the field that declared it (for problems).
struct Declared {
    field: String,
    key: KeyConfig,
}

/// Reads every key from the environment and checks the key tables; problems are
/// (field, fix), and every one is reported.
pub(super) fn validate(
    raw: RawKeys<'_>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Validated, Vec<(String, String)>> {
    let mut problems: Vec<(String, String)> = Vec::new();
    let mut declared: Vec<Declared> = Vec::new();
    // A secret pasted where its variable's name belongs is refused without being repeated.
    let read = |field: String, name: &str, problems: &mut Vec<(String, String)>| {
        let unset = "export it, or remove it from the list";
        match super::secrets::env_secret(name, "GATEWAY_KEY", unset, env) {
            Ok(secret) => Some(secret),
            Err(fix) => {
                problems.push((field, fix));
                None
            }
        }
    };
    for (list, field, role) in [
        (raw.api_keys_env, "api_keys_env", KeyRole::Client),
        (raw.admin_keys_env, "admin_keys_env", KeyRole::Admin),
    ] {
        for (n, name) in list.iter().enumerate() {
            let field = format!("server.{field}[{n}]");
            if let Some(secret) = read(field.clone(), name, &mut problems) {
                let grant = KeyGrant {
                    label: name.as_str().into(),
                    role,
                    tenant: None,
                    task_classes: None,
                };
                declared.push(Declared {
                    field,
                    key: KeyConfig { secret, grant },
                });
            }
        }
    }
    for (n, k) in raw.keys.into_iter().enumerate() {
        let at = |f: &str| format!("server.keys[{n}].{f}");
        let before = problems.len();
        let label = k.name.clone().unwrap_or_else(|| k.env.clone());
        if !valid_label(&label) {
            let field = if k.name.is_some() { "name" } else { "env" };
            problems.push((
                at(field),
                format!("`{label}` cannot be a key's label: use 1 to 128 letters, digits, `_`, `-` or `.` (the label names the key in logs and the audit log; set `name` to choose it)"),
            ));
        }
        if let Some(t) = &k.tenant {
            if !valid_tenant(t) {
                problems.push((
                    at("tenant"),
                    format!("`{t}` is not a tenant name: {TENANT_FIX}"),
                ));
            }
        }
        if let Some(classes) = &k.task_classes {
            if let Err((i, fix)) = super::checks::check_task_classes(classes) {
                problems.push((at(&format!("task_classes[{i}]")), fix));
            } else if classes.is_empty() {
                problems.push((
                    at("task_classes"),
                    "list at least one task class, or leave `task_classes` out to allow any".into(),
                ));
            }
        }
        if k.role == KeyRole::Admin && (k.tenant.is_some() || k.task_classes.is_some()) {
            problems.push((
                at("role"),
                "an admin key does not send traffic, so `tenant` and `task_classes` do not apply to it: remove them, or use role = \"client\" or \"judge\"".into(),
            ));
        }
        let secret = read(at("env"), &k.env, &mut problems);
        if let (Some(secret), true) = (secret, problems.len() == before) {
            declared.push(Declared {
                field: at("env"),
                key: KeyConfig {
                    secret,
                    grant: KeyGrant {
                        label: label.into(),
                        role: k.role,
                        tenant: k.tenant,
                        task_classes: k.task_classes,
                    },
                },
            });
        }
    }
    check_distinct(&declared, &mut problems);
    let rate = feedback_rate(raw.feedback_rate_per_key, raw.feedback_burst_per_key)
        .map_err(|p| problems.push(p))
        .ok()
        .flatten();
    if problems.is_empty() {
        Ok((declared.into_iter().map(|d| d.key).collect(), rate))
    } else {
        Err(problems)
    }
}

/// Labels are unique, and one key value is declared once: a value under two grants would
/// make the caller's identity (its tenant, its role) depend on the order of the list. The one
/// exception keeps older configurations working: the same key as a client key and as an
/// admin key (it then opens both kinds of route).
fn check_distinct(declared: &[Declared], problems: &mut Vec<(String, String)>) {
    for (i, d) in declared.iter().enumerate() {
        let admin = d.key.grant.role == KeyRole::Admin;
        // The exception below, declared by one variable in both lists: one label is right.
        let both_roles = |o: &Declared| {
            o.key.secret == d.key.secret && (o.key.grant.role == KeyRole::Admin) != admin
        };
        if let Some(other) = declared[..i]
            .iter()
            .find(|o| o.key.grant.label == d.key.grant.label && !both_roles(o))
        {
            problems.push((
                d.field.clone(),
                format!(
                    "the label `{}` is already {}'s: give each key its own `name`",
                    d.key.grant.label, other.field
                ),
            ));
            continue;
        }
        if let Some(other) = declared[..i]
            .iter()
            .find(|o| o.key.secret == d.key.secret && (o.key.grant.role == KeyRole::Admin) == admin)
        {
            problems.push((
                d.field.clone(),
                format!(
                    "holds the same key as {}: declare each key once (one table per key, with its tenant, task classes and role)",
                    other.field
                ),
            ));
        }
    }
}

/// `server.feedback_rate_per_key` and `server.feedback_burst_per_key`; absent: no cap.
fn feedback_rate(
    rate: Option<f64>,
    burst: Option<f64>,
) -> Result<Option<FeedbackRate>, (String, String)> {
    let Some(per_second) = rate else {
        return match burst {
            None => Ok(None),
            Some(_) => Err((
                "server.feedback_burst_per_key".into(),
                "applies only with server.feedback_rate_per_key: set that too, or remove this"
                    .into(),
            )),
        };
    };
    if !(per_second.is_finite() && per_second > 0.0) {
        return Err((
            "server.feedback_rate_per_key".into(),
            format!("`{per_second}` is not a rate: write a number of scores per second greater than 0, or leave it out for no cap"),
        ));
    }
    let burst = burst.unwrap_or_else(|| (2.0 * per_second).ceil().max(1.0));
    if !(burst.is_finite() && burst >= 1.0) {
        return Err((
            "server.feedback_burst_per_key".into(),
            format!("`{burst}` is not a burst: write a number of scores, at least 1 (default twice the rate)"),
        ));
    }
    Ok(Some(FeedbackRate { per_second, burst }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use crate::config::{load, load_all, KeyRole};

    const CHAT: &str = "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";

    fn env(name: &str) -> Option<String> {
        name.strip_prefix("K_").map(|k| format!("sk-value-{k}"))
    }

    #[test]
    fn key_tables_bind_a_tenant_task_classes_and_a_role_beside_the_plain_lists() {
        let text = format!(
            "[server]\napi_keys_env = [\"K_A\"]\nadmin_keys_env = [\"K_ADMIN\"]\nfeedback_rate_per_key = 5\n\
             [[server.keys]]\nenv = \"K_T1\"\nname = \"team-one\"\ntenant = \"t1\"\ntask_classes = [\"code\", \"chat\"]\n\
             [[server.keys]]\nenv = \"K_J\"\nrole = \"judge\"\n{CHAT}"
        );
        let cfg = load(&text, "x.toml", &env).unwrap();
        let grants: Vec<_> = cfg.keys.iter().map(|k| &k.grant).collect();
        let labels: Vec<&str> = grants.iter().map(|g| &*g.label).collect();
        assert_eq!(labels, ["K_A", "K_ADMIN", "team-one", "K_J"]);
        let roles: Vec<KeyRole> = grants.iter().map(|g| g.role).collect();
        assert_eq!(
            roles,
            [
                KeyRole::Client,
                KeyRole::Admin,
                KeyRole::Client,
                KeyRole::Judge
            ]
        );
        assert_eq!(grants[2].tenant.as_deref(), Some("t1"));
        assert_eq!(
            grants[2].task_classes.as_deref(),
            Some(&["code".to_owned(), "chat".to_owned()][..])
        );
        assert_eq!(cfg.keys[2].secret.0, "sk-value-T1");
        let rate = cfg.feedback_rate.unwrap();
        assert_eq!(
            (rate.per_second, rate.burst),
            (5.0, 10.0),
            "burst defaults to twice the rate"
        );
        assert!(
            !format!("{cfg:?}").contains("sk-value"),
            "Debug redacts keys"
        );
    }

    #[test]
    fn bad_key_tables_name_the_field_and_the_fix() {
        let cases = [
            (
                "[[server.keys]]\nenv = \"K_A\"\ntenant = \"t 1\"",
                "server.keys[0].tenant",
                "visible ASCII",
            ),
            (
                "[[server.keys]]\nenv = \"K_A\"\ntask_classes = [\"code\", \"code\"]",
                "server.keys[0].task_classes[1]",
                "listed twice",
            ),
            (
                "[[server.keys]]\nenv = \"K_A\"\ntask_classes = []",
                "server.keys[0].task_classes",
                "leave `task_classes` out",
            ),
            (
                "[[server.keys]]\nenv = \"K_A\"\nrole = \"admin\"\ntenant = \"t1\"",
                "server.keys[0].role",
                "remove them",
            ),
            (
                "[[server.keys]]\nenv = \"K_A\"\nname = \"a b\"",
                "server.keys[0].name",
                "letters, digits",
            ),
            (
                "[[server.keys]]\nenv = \"NOT_SET\"",
                "server.keys[0].env",
                "is not set",
            ),
            (
                "api_keys_env = [\"K_A\"]\n[[server.keys]]\nenv = \"K_A\"\ntenant = \"t1\"",
                "server.keys[0].env",
                "already server.api_keys_env[0]'s",
            ),
            (
                "api_keys_env = [\"K_A\"]\n[[server.keys]]\nenv = \"K_B\"\nname = \"K_A\"",
                "server.keys[0].env",
                "give each key its own `name`",
            ),
            (
                "feedback_rate_per_key = 0",
                "server.feedback_rate_per_key",
                "greater than 0",
            ),
            (
                "feedback_burst_per_key = 3",
                "server.feedback_burst_per_key",
                "set that too",
            ),
            (
                "feedback_rate_per_key = 2\nfeedback_burst_per_key = 0.5",
                "server.feedback_burst_per_key",
                "at least 1",
            ),
        ];
        for (server, field, fix) in cases {
            let text = format!("[server]\n{server}\n{CHAT}");
            let e = load(&text, "x.toml", &env).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.fix.contains(fix), "{e}");
            assert!(!e.to_string().contains("sk-value"), "{e}");
        }
        // Two variables holding one key: the second names the first, never the value.
        let same = |_: &str| Some("sk-one-value".to_owned());
        let text = format!("[server]\napi_keys_env = [\"K_A\"]\n[[server.keys]]\nenv = \"K_T\"\ntenant = \"t1\"\n{CHAT}");
        let e = load(&text, "x.toml", &same).unwrap_err();
        assert_eq!(e.field, "server.keys[0].env");
        assert!(
            e.fix
                .contains("holds the same key as server.api_keys_env[0]")
                && !e.fix.contains("sk-one"),
            "{e}"
        );
        // The same key as a client key and an admin key still loads (as it always did), from
        // two variables or from one.
        for admin in ["K_B", "K_A"] {
            let text = format!(
                "[server]\napi_keys_env = [\"K_A\"]\nadmin_keys_env = [\"{admin}\"]\n{CHAT}"
            );
            assert!(load(&text, "x.toml", &same).is_ok(), "{admin}");
        }
        // A provider's tenant no header could carry.
        let text = CHAT.replace(
            "kind = \"sim\"",
            "kind = \"sim\"\ntenants = [\"t1\", \"équipe\"]",
        );
        let e = load_all(&text, "x.toml", &env).unwrap_err();
        assert_eq!(e[0].field, "interfaces.chat.providers[0].tenants", "{e:?}");
        assert!(e[0].fix.contains("`équipe` (entry 1)"), "{e:?}");
    }
}
