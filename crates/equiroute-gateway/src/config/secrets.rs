//! Secrets read from the environment by name: [`Secret`] and [`AwsCredentials`], whose `Debug`
//! shows nothing, and the check that refuses a secret pasted where its variable's name belongs.

/// AWS credentials of a `bedrock` provider, read from the standard environment variables
/// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, optional `AWS_SESSION_TOKEN`). Its `Debug`
/// shows none of them.
#[derive(Clone, PartialEq, Eq)]
pub struct AwsCredentials {
    pub access_key_id: Secret,
    pub secret_access_key: Secret,
    pub session_token: Option<Secret>,
}

impl AwsCredentials {
    #[must_use]
    pub fn new(access_key_id: &str, secret_access_key: &str, session_token: Option<&str>) -> Self {
        AwsCredentials {
            access_key_id: Secret(access_key_id.to_owned()),
            secret_access_key: Secret(secret_access_key.to_owned()),
            session_token: session_token.map(|t| Secret(t.to_owned())),
        }
    }

    /// The signing crate's identity of these credentials.
    #[must_use]
    pub fn identity(&self) -> aws_smithy_runtime_api::client::identity::Identity {
        aws_credential_types::Credentials::new(
            &self.access_key_id.0,
            &self.secret_access_key.0,
            self.session_token.as_ref().map(|t| t.0.clone()),
            None,
            "environment",
        )
        .into()
    }

    /// The values that must never appear in a reply, an error or a log line.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        [
            Some(&self.access_key_id),
            Some(&self.secret_access_key),
            self.session_token.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(|s| s.0.as_str())
    }
}

impl std::fmt::Debug for AwsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AwsCredentials(<redacted>)")
    }
}

/// A secret read from the environment. Its `Debug` never shows the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// The secret in the environment variable `name`, or what is wrong: `name` is no variable's
/// name (see [`not_a_variable_name`]; `example` is one for the field), or the variable is not
/// set (or empty), which `unset_fix` says how to mend.
pub(crate) fn env_secret(
    name: &str,
    example: &str,
    unset_fix: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Secret, String> {
    if let Some(fix) = not_a_variable_name(name, example) {
        return Err(fix);
    }
    match env(name) {
        Some(v) if !v.is_empty() => Ok(Secret(v)),
        _ => Err(format!(
            "environment variable `{name}` is not set: {unset_fix}"
        )),
    }
}

/// Why `name`, written in a field that names the environment variable holding a secret
/// (`api_key_env`, `api_keys_env`, `admin_keys_env`, `url_env`), is not such a name: it has a
/// credential's shape (`sk-…`, `AKIA…`, a URL with a password), is not a variable name at all
/// (letters, digits and `_`, not starting with a digit), or looks like a random token. A
/// secret pasted where its variable's name belongs is never repeated: the answer says what
/// it looks like and what to write instead, `example` being a variable name for the field.
fn not_a_variable_name(name: &str, example: &str) -> Option<String> {
    let is_name = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    // Variable names are words joined by `_`; keys are long runs of mixed letters and digits.
    let token_like = name.len() >= 20
        && !name.contains('_')
        && name.chars().any(|c| c.is_ascii_digit())
        && name.chars().any(|c| c.is_ascii_lowercase());
    let why = if crate::redact::looks_like_credential(name) {
        "it has the shape of a credential"
    } else if !is_name {
        "a variable name is letters, digits and `_`, not starting with a digit"
    } else if token_like {
        "it looks like a random token, not a name"
    } else {
        return None;
    };
    Some(format!(
        "this looks like a secret value, not the name of an environment variable ({why}); the \
         value is not shown. Put the secret in an environment variable (export \
         {example}=...) and write the variable's name here (\"{example}\"); if the value was \
         saved in a file or shared, rotate it"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{load, load_all, KeyRole};

    #[test]
    fn secrets_come_from_the_environment_and_are_not_in_errors() {
        let text = "[server]\napi_keys_env = [\"GW_KEY\"]\n[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        let env = |name: &str| (name == "GW_KEY").then(|| "s3cret-value".to_owned());
        let cfg = load(text, "x.toml", &env).unwrap();
        assert_eq!(cfg.keys.len(), 1);
        assert_eq!(cfg.keys[0].secret, Secret("s3cret-value".to_owned()));
        assert_eq!(
            &*cfg.keys[0].grant.label, "GW_KEY",
            "labelled by the variable's name"
        );
        assert_eq!(cfg.keys[0].grant.role, KeyRole::Client);
        assert!(
            !format!("{cfg:?}").contains("s3cret"),
            "Debug redacts secrets"
        );
        assert!(
            !format!("{:?}", load("[server]\nlisten = \"nope\"", "x.toml", &env))
                .contains("s3cret")
        );
    }

    #[test]
    fn a_secret_pasted_where_its_variable_name_belongs_is_never_repeated() {
        let provider = |kind: &str, extra: &str| {
            format!("[[interfaces.chat.providers]]\nid = \"{kind}\"\nkind = \"{kind}\"\nbase_url = \"http://x/v1\"\n{extra}\n")
        };
        let pasted = [
            "sk-proj-AbCdEf0123456789xyz",
            "AKIAIOSFODNN7EXAMPLE",
            "a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6",
            "redis://:hunter2-pw@10.0.0.1:6379",
            "3f9a-key with spaces",
        ];
        let text = format!(
            "[server]\napi_keys_env = [\"{}\"]\nadmin_keys_env = [\"OK_NAME\", \"{}\"]\n\
             [state]\nbackend = \"redis\"\nurl_env = \"{}\"\n\
             [interfaces.judged]\nkind = \"chat\"\n\
             judge = {{ base_url = \"http://j/v1\", model = \"m\", api_key_env = \"{}\" }}\n\
             [[interfaces.judged.providers]]\nid = \"s\"\nkind = \"sim\"\n\
             sim = {{ latency = {{ p50_ms = 10, p95_ms = 20 }} }}\n\
             [interfaces.chat]\nkind = \"chat\"\n{}{}",
            pasted[0],
            pasted[2],
            pasted[3],
            pasted[4],
            provider("openai", &format!("api_key_env = \"{}\"", pasted[1])),
            provider("anthropic", "api_key_env = \"UNSET_NAME\""),
        );
        let env = |name: &str| (name == "OK_NAME").then(|| "fine".to_owned());
        let problems = load_all(&text, "x.toml", &env).unwrap_err();
        let shown: Vec<(String, String)> = problems
            .iter()
            .map(|p| (p.field.clone(), p.to_string()))
            .collect();
        for value in pasted {
            assert!(
                shown.iter().all(|(_, text)| !text.contains(value)),
                "{value} is repeated: {shown:#?}"
            );
        }
        let looks = |field: &str| {
            shown.iter().any(|(f, text)| {
                f == field
                    && text.contains(
                        "looks like a secret value, not the name of an environment variable",
                    )
                    && text.contains("rotate it")
            })
        };
        for field in [
            "server.api_keys_env[0]",
            "server.admin_keys_env[1]",
            "state.url_env",
            "interfaces.judged.judge.api_key_env",
            "interfaces.chat.providers[0].api_key_env",
        ] {
            assert!(looks(field), "{field}: {shown:#?}");
        }
        // A real variable's name that is not set is named, as before.
        assert!(
            shown
                .iter()
                .any(|(f, text)| f == "interfaces.chat.providers[1].api_key_env"
                    && text.contains("environment variable `UNSET_NAME` is not set")),
            "{shown:#?}"
        );
        // A key pasted as the list's text, not in a list: serde's message would quote it.
        let e = load(
            "[server]\napi_keys_env = \"sk-proj-AbCdEf0123456789xyz\"\n",
            "x.toml",
            &env,
        )
        .unwrap_err();
        assert_eq!(e.field, "server.api_keys_env");
        assert!(
            !e.to_string().contains("AbCdEf0123456789") && e.fix.contains("is not shown"),
            "{e}"
        );
    }
}
