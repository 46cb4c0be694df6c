//! The policies to evaluate (`--policies`) and the changes laid over their parameters
//! (`--set`), checked before any log is read.

use anyhow::{bail, Context};
use equiroute_core::policies::{PolicyConfig, PolicyKind};
use serde_json::Value;

/// Policies that read the request's features: they cannot be replayed without them.
pub(crate) fn reads_features(kind: PolicyKind) -> bool {
    matches!(
        kind,
        PolicyKind::Lqm | PolicyKind::LqmTs | PolicyKind::Linucb | PolicyKind::Additive
    )
}

/// The context-free policies, for the message that says which ones a log without features
/// can evaluate.
pub(crate) fn context_free_names() -> String {
    PolicyKind::ALL
        .iter()
        .filter(|k| !reads_features(**k) && **k != PolicyKind::Oracle)
        .map(|k| k.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A policy to evaluate: its name and the `--set` changes to lay over its base parameters.
#[derive(Debug)]
pub struct Target {
    pub(crate) kind: PolicyKind,
    sets: Vec<(Vec<String>, Value)>,
}

impl Target {
    /// The configuration on `iface`: its configured one when it is the same policy, else the
    /// defaults; then the `--set` changes.
    pub(crate) fn config(&self, configured: Option<&PolicyConfig>) -> anyhow::Result<PolicyConfig> {
        let base = configured
            .filter(|c| c.kind() == self.kind)
            .cloned()
            .unwrap_or_else(|| PolicyConfig::default_for(self.kind));
        let mut json = serde_json::to_value(&base)?;
        for (fields, value) in &self.sets {
            let mut node = &mut json;
            for (n, f) in fields.iter().enumerate() {
                let Some(obj) = node.as_object_mut() else {
                    bail!(
                        "--set `{}.{}`: `{}` is not a table of `{}`",
                        self.kind,
                        fields.join("."),
                        fields[..n].join("."),
                        self.kind
                    );
                };
                node = obj.entry(f.clone()).or_insert(Value::Null);
            }
            *node = value.clone();
        }
        serde_json::from_value(json).map_err(|e| {
            anyhow::anyhow!(
                "--set on `{}`: {e} (`equiroute policies {}` lists its fields)",
                self.kind,
                self.kind
            )
        })
    }
}

/// `--policies` and `--set`, checked before any log is read.
///
/// # Errors
/// A policy unknown, named twice or the oracle; a `--set` malformed, of another policy, or
/// that does not fit the policy's parameters.
pub fn targets(policies: &[String], sets: &[String]) -> anyhow::Result<Vec<Target>> {
    let mut out: Vec<Target> = Vec::new();
    for name in policies {
        let kind: PolicyKind = name.trim().parse().with_context(|| {
            format!("--policies `{name}` (`equiroute policies` lists the policies)")
        })?;
        if kind == PolicyKind::Oracle {
            bail!("--policies `oracle`: the oracle reads a simulated world's true means, which a log does not have; it exists only in `equiroute bench`");
        }
        if out.iter().any(|t| t.kind == kind) {
            bail!("--policies names `{name}` twice");
        }
        out.push(Target {
            kind,
            sets: Vec::new(),
        });
    }
    let fix = "write POLICY.FIELD=VALUE, e.g. lqm-ts.lqm.l_ref_ms=800";
    for set in sets {
        let (path, value) = set
            .split_once('=')
            .with_context(|| format!("--set `{set}`: {fix}"))?;
        let mut parts = path.split('.');
        let policy = parts.next().unwrap_or_default();
        let fields: Vec<String> = parts.map(str::to_owned).collect();
        if policy.is_empty() || fields.iter().any(String::is_empty) || fields.is_empty() {
            bail!("--set `{set}`: {fix}");
        }
        let names: Vec<&str> = out.iter().map(|t| t.kind.as_str()).collect();
        let Some(target) = out.iter_mut().find(|t| t.kind.as_str() == policy) else {
            bail!(
                "--set `{set}`: `{policy}` is not one of --policies ({}): add it there",
                names.join(",")
            );
        };
        let parsed: Value =
            serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()));
        target.sets.push((fields, parsed));
        // Fail now, with the field named, rather than once per interface.
        target
            .config(None)
            .with_context(|| format!("--set `{set}`"))?;
    }
    Ok(out)
}
