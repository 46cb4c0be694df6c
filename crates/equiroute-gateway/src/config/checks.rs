//! Checks that several sections share: interface and provider names, task classes, and the
//! policies the gateway refuses.

use super::defaults::{MAX_NAME_LEN, MAX_TASK_CLASS_BYTES};
use equiroute_core::policies::PolicyConfig;

/// An interface's `task_classes`: names as the trimmed header gives them, each once. The
/// error is the index at fault and the fix.
pub(super) fn check_task_classes(classes: &[String]) -> Result<(), (usize, String)> {
    for (n, c) in classes.iter().enumerate() {
        if c.is_empty() || c.trim() != c {
            return Err((
                n,
                "must be a non-empty name without surrounding spaces (the header's value is trimmed)".into(),
            ));
        }
        if c.len() > MAX_TASK_CLASS_BYTES {
            return Err((
                n,
                format!(
                    "is {} bytes long: a task class header longer than {} bytes is treated as no class, so shorten the name",
                    c.len(),
                    MAX_TASK_CLASS_BYTES
                ),
            ));
        }
        if classes[..n].contains(c) {
            return Err((n, format!("`{c}` is listed twice")));
        }
    }
    Ok(())
}

/// Policies that exist only in the laboratory are refused by the gateway, with the reason.
pub(super) fn refuse_laboratory_policies(policy: &PolicyConfig) -> Result<(), String> {
    if policy.kind() == equiroute_core::policies::PolicyKind::Oracle {
        return Err(
            "`oracle` exists only in the laboratory (it reads the simulated world's \
                    true means, which a gateway cannot know): choose another policy, e.g. \
                    \"lqm-ts\""
                .into(),
        );
    }
    Ok(())
}

/// An interface name or provider id: it appears in URLs (`/v1/tools/NAME`), in `model`
/// (`interface/provider`), in headers and in metric labels, so it is 1–64 ASCII letters,
/// digits, `-`, `_`, `.` or `:`. The error says which character is wrong and a name that
/// would do.
pub(super) fn check_name(what: &str, name: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
    if name.is_empty() {
        return Err(format!("{what} must not be empty"));
    }
    if let Some(bad) = name.chars().find(|&c| !allowed(c)) {
        let fixed: String = name
            .chars()
            .map(|c| if allowed(c) { c } else { '_' })
            .collect();
        return Err(format!(
            "{what} are ASCII letters, digits, `-`, `_`, `.` and `:` (they appear in URLs, \
             model ids, headers and metric labels); {bad:?} is not one: rename it, e.g. `{fixed}`"
        ));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "{what} are at most {MAX_NAME_LEN} characters; this one has {}: shorten it",
            name.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{load, no_env};

    /// Names go into URLs, `model`, headers and metric labels: a space, a `/`, a
    /// non-ASCII letter or an over-long name is refused with a name that would do.
    #[test]
    fn interface_names_and_provider_ids_are_url_safe() {
        let config = |iface: &str, id: &str| {
            format!("[interfaces.{iface}]\nkind = \"chat\"\n[[interfaces.{iface}.providers]]\nid = \"{id}\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 10, p95_ms = 20 }} }}\n")
        };
        for (iface, id) in [("chat", "gpt-4o.mini:flex_2"), ("web_search", "A.b-c:d_9")] {
            let cfg = load(&config(iface, id), "x.toml", &no_env);
            assert!(cfg.is_ok(), "{iface}/{id}: {:?}", cfg.err());
        }
        let long = "a".repeat(MAX_NAME_LEN + 1);
        let cases = [
            (
                config("\"web search\"", "a"),
                "interfaces.web search",
                "e.g. `web_search`",
            ),
            (
                config("chat", "team/a"),
                "interfaces.chat.providers[0].id",
                "'/' is not one: rename it, e.g. `team_a`",
            ),
            (
                config("chat", "café"),
                "interfaces.chat.providers[0].id",
                "e.g. `caf_`",
            ),
            (
                config("chat", ""),
                "interfaces.chat.providers[0].id",
                "must not be empty",
            ),
            (
                config(&long, "a"),
                &format!("interfaces.{long}"),
                "at most 64 characters; this one has 65",
            ),
        ];
        for (text, field, fix) in &cases {
            let e = load(text, "x.toml", &no_env).unwrap_err();
            assert_eq!(&e.field, field, "{e}");
            assert!(e.fix.contains(fix), "{e}");
        }
    }
}
