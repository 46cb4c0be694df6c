//! How a configuration's problems are reported: [`ConfigError`] (the file, the field, the fix),
//! and the rewording of the TOML reader's messages (no secret echoed, only the gateway's policies).

/// A configuration problem: the file, the field path and the fix.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
#[error("{file}: `{field}`: {fix}")]
pub struct ConfigError {
    pub file: String,
    pub field: String,
    pub fix: String,
}

/// The core's "unknown policy" message with only the policies the gateway accepts (`oracle`
/// is the laboratory's) and the nearest name; other messages as they are.
pub(super) fn gateway_policies(fix: &str) -> String {
    let Some((head, _)) = fix.split_once(": valid policies are ") else {
        return fix.to_owned();
    };
    let place = fix.rfind(" (line ").map_or("", |i| &fix[i..]);
    let accepted: Vec<&str> = equiroute_core::policies::PolicyKind::ALL
        .iter()
        .map(|k| k.as_str())
        .filter(|k| *k != "oracle")
        .collect();
    let given = head.split('`').nth(1).unwrap_or_default();
    let hint = equiroute_toml::nearest(given, &accepted)
        .map_or(String::new(), |k| format!(" (did you mean `{k}`?)"));
    format!("{head}: write one of {}{hint}{place}", accepted.join(", "))
}

/// A problem of reading the file, with no value of a field that names a secret's variable
/// (`api_key_env = ["sk-…"]` is read as "a sequence, not a string" by serde, whose message
/// quotes the value) and no credential-shaped text anywhere.
pub(super) fn unechoed(field: &str, fix: &str) -> String {
    let names_a_variable = field
        .rsplit('.')
        .next()
        .is_some_and(|last| last.split('[').next().is_some_and(|f| f.ends_with("_env")));
    if names_a_variable {
        let place = fix.rfind(" (line ").map_or("", |i| &fix[i..]);
        return format!(
            "must name environment variables (a string for api_key_env and url_env, a list of \
             strings for api_keys_env and admin_keys_env), e.g. [\"GATEWAY_KEY\"]; the value \
             given is not shown{place}"
        );
    }
    crate::redact::Redactor::shapes_only()
        .redact(fix)
        .as_str()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use crate::config::{load, no_env};

    #[test]
    fn parse_errors_name_the_path_the_line_and_the_column() {
        let base = "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 10, p95_ms = 20 } }\n";
        let cases = [
            (
                base.replace("kind = \"sim\"", "kind = \"sim\"\nweight = 3"),
                "interfaces.chat.providers[0].weight",
                "unknown field `weight`",
                "(line 6, column 1)",
            ),
            (
                base.replace("p50_ms = 10", "p50_ms = \"ten\""),
                "interfaces.chat.providers[0].sim.latency.p50_ms",
                "expected a number, e.g. `p50_ms = 1.5`, got a string",
                "(line 6, column 30)",
            ),
            (
                base.replace("\"chat\"", "\"chatt\""),
                "interfaces.chat.kind",
                "write one of `chat`, `tool` (did you mean `chat`?)",
                "(line 2, column 8)",
            ),
            (
                format!("[sever]\n{base}"),
                "sever",
                "did you mean `server`?",
                "(line 1, column 2)",
            ),
            (
                base.replace("\"chat\"", "chat"),
                "(syntax)",
                "string values must be quoted",
                "(line 2, column 8)",
            ),
        ];
        for (text, field, what, place) in cases {
            let e = load(&text, "x.toml", &no_env).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.fix.contains(what) && e.fix.ends_with(place), "{e}");
        }
    }
}
