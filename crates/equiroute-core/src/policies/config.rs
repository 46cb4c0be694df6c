//! Policy names and configurations: one way to build any policy by name.
//!
//! Configuration is parsed (serde, unknown fields rejected) and then validated by
//! [`PolicyConfig::build`], which checks every range and every candidate reference and
//! returns a ready policy or an error naming the field and the fix.

use super::{
    Additive, AdditiveConfig, Cheapest, CheapestConfig, ExplorationFloor, ExplorationFloorConfig,
    LeastBusy, LeastLatency, LeastLatencyConfig, LinUcbPolicy, LinUcbPolicyConfig, Lqm, LqmConfig,
    LqmTs, LqmTsConfig, Oracle, Policy, PriorityCooldown, PriorityCooldownConfig, RandomOrder,
    RoundRobin, Static, StaticConfig, SwUcb, SwUcbConfig, TsDeadline, TsDeadlineConfig,
};
use crate::decision::Candidate;
use crate::ConfigError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Every policy Equiroute knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    Lqm,
    TsDeadline,
    LqmTs,
    SwUcb,
    Linucb,
    Additive,
    PriorityCooldown,
    RoundRobin,
    Random,
    Static,
    LeastLatency,
    LeastBusy,
    Cheapest,
    Oracle,
}

impl PolicyKind {
    /// All policies, in documentation order.
    pub const ALL: [PolicyKind; 14] = [
        PolicyKind::Lqm,
        PolicyKind::TsDeadline,
        PolicyKind::LqmTs,
        PolicyKind::SwUcb,
        PolicyKind::Linucb,
        PolicyKind::Additive,
        PolicyKind::PriorityCooldown,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::Static,
        PolicyKind::LeastLatency,
        PolicyKind::LeastBusy,
        PolicyKind::Cheapest,
        PolicyKind::Oracle,
    ];

    /// The configuration name, e.g. `ts-deadline`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Lqm => "lqm",
            PolicyKind::TsDeadline => "ts-deadline",
            PolicyKind::LqmTs => "lqm-ts",
            PolicyKind::SwUcb => "sw-ucb",
            PolicyKind::Linucb => "linucb",
            PolicyKind::Additive => "additive",
            PolicyKind::PriorityCooldown => "priority-cooldown",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::Random => "random",
            PolicyKind::Static => "static",
            PolicyKind::LeastLatency => "least-latency",
            PolicyKind::LeastBusy => "least-busy",
            PolicyKind::Cheapest => "cheapest",
            PolicyKind::Oracle => "oracle",
        }
    }

    /// One line on what the policy does.
    #[must_use]
    pub fn summary(self) -> &'static str {
        match self {
            PolicyKind::Lqm => {
                "LQM-ContextRoute: contextual quality per service cycle, LinUCB exploration"
            }
            PolicyKind::TsDeadline => {
                "deadline-risk Thompson sampling over failure, latency tail and cost"
            }
            PolicyKind::LqmTs => {
                "ours: contextual quality per cycle x sampled P(good) per unit of cost"
            }
            PolicyKind::SwUcb => "sliding-window UCB on the quality score",
            PolicyKind::Linucb => "disjoint LinUCB on quality, latency ignored",
            PolicyKind::Additive => {
                "LinUCB on alpha*u - (1-alpha)*latency (the collapsing baseline)"
            }
            PolicyKind::PriorityCooldown => "fixed priority list with LiteLLM-style cooldowns",
            PolicyKind::RoundRobin => "rotate through the candidates",
            PolicyKind::Random => "uniformly random order",
            PolicyKind::Static => "one fixed candidate first",
            PolicyKind::LeastLatency => "lowest latency EMA first",
            PolicyKind::LeastBusy => "fewest in-flight attempts first",
            PolicyKind::Cheapest => "cheapest healthy candidate first",
            PolicyKind::Oracle => "true expected values (laboratory only, for regret)",
        }
    }

    fn valid_list() -> String {
        PolicyKind::ALL
            .iter()
            .map(|k| k.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| ConfigError::UnknownPolicy {
                name: s.to_owned(),
                valid: PolicyKind::valid_list(),
            })
    }
}

/// No parameters (unknown fields are still rejected).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// A policy and its parameters, as written in configuration: a table
/// `{ name = "lqm", l_ref_ms = 800 }`, or just the name, `"lqm"`, for its defaults.
///
/// (The derives generate inherent `serialize`/`deserialize` functions of the tagged form,
/// `remote = "Self"`; the trait impls below add the string form and plain error messages.)
// Built once per interface and matched by value in many places: `lqm-ts`'s 440 bytes are
// not worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(remote = "Self", tag = "name", rename_all = "kebab-case")]
pub enum PolicyConfig {
    Lqm(LqmConfig),
    TsDeadline(TsDeadlineConfig),
    /// Its nested `lqm`, `lqm.head` and `risk` tables differ from those policies' defaults,
    /// so a partial table is laid over `lqm-ts`'s own defaults, not theirs.
    #[serde(deserialize_with = "over_defaults")]
    LqmTs(LqmTsConfig),
    SwUcb(SwUcbConfig),
    Linucb(LinUcbPolicyConfig),
    Additive(AdditiveConfig),
    PriorityCooldown(PriorityCooldownConfig),
    RoundRobin(NoParams),
    Random(NoParams),
    Static(StaticConfig),
    LeastLatency(LeastLatencyConfig),
    LeastBusy(NoParams),
    Cheapest(CheapestConfig),
    Oracle(NoParams),
}

impl Serialize for PolicyConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        PolicyConfig::serialize(self, s)
    }
}

impl<'de> Deserialize<'de> for PolicyConfig {
    /// A name (`"lqm-ts"`) or a table with a `name` (`{ name = "lqm-ts", … }`); errors say
    /// which, never serde's internal type names.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let shape = "a policy is a name such as \"lqm-ts\" or a table such as \
                     { name = \"lqm-ts\", lqm = { l_ref_ms = 800 } }";
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(name) => {
                PolicyConfig::from_name(&name).map_err(D::Error::custom)
            }
            serde_json::Value::Object(table) => {
                let Some(name) = table.get("name") else {
                    return Err(D::Error::custom(format!(
                        "the policy table has no `name`: {shape} (policies: {})",
                        PolicyKind::valid_list()
                    )));
                };
                let Some(kind) = name.as_str() else {
                    return Err(D::Error::custom(format!(
                        "the policy's `name` must be a string: {shape}"
                    )));
                };
                let kind = kind.parse::<PolicyKind>().map_err(D::Error::custom)?;
                PolicyConfig::deserialize(serde_json::Value::Object(table))
                    .map_err(|e| D::Error::custom(format!("policy `{kind}`: {e}")))
            }
            other => Err(D::Error::custom(format!(
                "{shape}, got {}",
                match other {
                    serde_json::Value::Null => "nothing",
                    serde_json::Value::Bool(_) => "a boolean",
                    serde_json::Value::Number(_) => "a number",
                    _ => "a list",
                }
            ))),
        }
    }
}

/// Deserializes `T` from a table laid over `T::default()`, nested tables included: a
/// partial `lqm = { l_ref_ms = 800 }` keeps every other field of the policy's own default,
/// where serde's `default` would fill them from the nested type's default.
fn over_defaults<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Serialize + serde::de::DeserializeOwned,
{
    use serde::de::Error;
    fn lay(base: &mut serde_json::Value, given: serde_json::Value) {
        match (base, given) {
            (serde_json::Value::Object(b), serde_json::Value::Object(g)) => {
                for (k, v) in g {
                    match b.get_mut(&k) {
                        Some(slot) => lay(slot, v),
                        None => {
                            b.insert(k, v);
                        }
                    }
                }
            }
            (slot, v) => *slot = v,
        }
    }
    let given = serde_json::Value::deserialize(d)?;
    let mut merged = serde_json::to_value(T::default()).map_err(D::Error::custom)?;
    lay(&mut merged, given);
    serde_json::from_value(merged).map_err(D::Error::custom)
}

impl PolicyConfig {
    /// The policy `kind` with default parameters.
    #[must_use]
    pub fn default_for(kind: PolicyKind) -> PolicyConfig {
        match kind {
            PolicyKind::Lqm => PolicyConfig::Lqm(LqmConfig::default()),
            PolicyKind::TsDeadline => PolicyConfig::TsDeadline(TsDeadlineConfig::default()),
            PolicyKind::LqmTs => PolicyConfig::LqmTs(LqmTsConfig::default()),
            PolicyKind::SwUcb => PolicyConfig::SwUcb(SwUcbConfig::default()),
            PolicyKind::Linucb => PolicyConfig::Linucb(LinUcbPolicyConfig::default()),
            PolicyKind::Additive => PolicyConfig::Additive(AdditiveConfig::default()),
            PolicyKind::PriorityCooldown => {
                PolicyConfig::PriorityCooldown(PriorityCooldownConfig::default())
            }
            PolicyKind::RoundRobin => PolicyConfig::RoundRobin(NoParams {}),
            PolicyKind::Random => PolicyConfig::Random(NoParams {}),
            PolicyKind::Static => PolicyConfig::Static(StaticConfig::default()),
            PolicyKind::LeastLatency => PolicyConfig::LeastLatency(LeastLatencyConfig::default()),
            PolicyKind::LeastBusy => PolicyConfig::LeastBusy(NoParams {}),
            PolicyKind::Cheapest => PolicyConfig::Cheapest(CheapestConfig::default()),
            PolicyKind::Oracle => PolicyConfig::Oracle(NoParams {}),
        }
    }

    /// The policy called `name` with default parameters.
    ///
    /// # Errors
    /// An unknown name; the message lists the valid ones.
    pub fn from_name(name: &str) -> Result<PolicyConfig, ConfigError> {
        Ok(PolicyConfig::default_for(name.parse()?))
    }

    /// Which policy this configures.
    #[must_use]
    pub fn kind(&self) -> PolicyKind {
        match self {
            PolicyConfig::Lqm(_) => PolicyKind::Lqm,
            PolicyConfig::TsDeadline(_) => PolicyKind::TsDeadline,
            PolicyConfig::LqmTs(_) => PolicyKind::LqmTs,
            PolicyConfig::SwUcb(_) => PolicyKind::SwUcb,
            PolicyConfig::Linucb(_) => PolicyKind::Linucb,
            PolicyConfig::Additive(_) => PolicyKind::Additive,
            PolicyConfig::PriorityCooldown(_) => PolicyKind::PriorityCooldown,
            PolicyConfig::RoundRobin(_) => PolicyKind::RoundRobin,
            PolicyConfig::Random(_) => PolicyKind::Random,
            PolicyConfig::Static(_) => PolicyKind::Static,
            PolicyConfig::LeastLatency(_) => PolicyKind::LeastLatency,
            PolicyConfig::LeastBusy(_) => PolicyKind::LeastBusy,
            PolicyConfig::Cheapest(_) => PolicyKind::Cheapest,
            PolicyConfig::Oracle(_) => PolicyKind::Oracle,
        }
    }

    /// Validates the parameters against the interface's candidates and feature dimension and
    /// builds the policy.
    ///
    /// # Errors
    /// No candidates, a parameter out of range, or an unknown candidate id.
    pub fn build(
        &self,
        candidates: &[Candidate],
        dim: usize,
    ) -> Result<Box<dyn Policy>, ConfigError> {
        let k = candidates.len();
        if k == 0 {
            return Err(ConfigError::NoCandidates);
        }
        crate::features::Featurizer::new(dim)?;
        Ok(match self {
            PolicyConfig::Lqm(c) => {
                c.validate()?;
                Box::new(Lqm::new(k, dim, *c))
            }
            PolicyConfig::TsDeadline(c) => {
                c.validate()?;
                Box::new(TsDeadline::new(k, *c))
            }
            PolicyConfig::LqmTs(c) => {
                c.validate()?;
                Box::new(LqmTs::new(k, dim, *c))
            }
            PolicyConfig::SwUcb(c) => {
                c.validate()?;
                Box::new(SwUcb::new(k, *c))
            }
            PolicyConfig::Linucb(c) => {
                c.validate()?;
                Box::new(LinUcbPolicy::new(k, dim, *c))
            }
            PolicyConfig::Additive(c) => {
                c.validate()?;
                Box::new(Additive::new(k, dim, *c))
            }
            PolicyConfig::PriorityCooldown(c) => {
                c.validate()?;
                let mut position = vec![usize::MAX; k];
                for (pos, id) in c.order.iter().enumerate() {
                    let i = candidate_index("order", id, candidates)?;
                    if position[i] == usize::MAX {
                        position[i] = pos;
                    }
                }
                // Unlisted candidates follow, in configuration order.
                let mut next = c.order.len();
                for p in &mut position {
                    if *p == usize::MAX {
                        *p = next;
                        next += 1;
                    }
                }
                Box::new(PriorityCooldown::new(position, c.clone()))
            }
            PolicyConfig::RoundRobin(_) => Box::new(RoundRobin::default()),
            PolicyConfig::Random(_) => Box::new(RandomOrder),
            PolicyConfig::Static(c) => {
                let i = match &c.candidate {
                    Some(id) => candidate_index("candidate", id, candidates)?,
                    None => 0,
                };
                Box::new(Static::new(i))
            }
            PolicyConfig::LeastLatency(c) => {
                if !(c.ema_beta > 0.0 && c.ema_beta <= 1.0) {
                    return Err(crate::error::out_of_range(
                        "ema_beta",
                        c.ema_beta,
                        "must be in (0, 1] (default 0.2)",
                    ));
                }
                Box::new(LeastLatency::new(k, *c))
            }
            PolicyConfig::LeastBusy(_) => Box::new(LeastBusy),
            PolicyConfig::Cheapest(c) => {
                crate::error::unit_interval("max_failure_rate", c.max_failure_rate)?;
                c.failure.validate()?;
                Box::new(Cheapest::new(k, *c))
            }
            PolicyConfig::Oracle(_) => Box::new(Oracle),
        })
    }
}

impl PolicyConfig {
    /// [`PolicyConfig::build`], wrapped in an exploration floor when `floor` is active
    /// (`min_propensity > 0`).
    ///
    /// # Errors
    /// As [`PolicyConfig::build`], or the floor's parameters are out of range.
    pub fn build_with_floor(
        &self,
        candidates: &[Candidate],
        dim: usize,
        floor: &ExplorationFloorConfig,
    ) -> Result<Box<dyn Policy>, ConfigError> {
        floor.validate()?;
        let policy = self.build(candidates, dim)?;
        Ok(if floor.is_active() {
            Box::new(ExplorationFloor::new(policy, *floor)?)
        } else {
            policy
        })
    }
}

fn candidate_index(
    field: &'static str,
    id: &str,
    candidates: &[Candidate],
) -> Result<usize, ConfigError> {
    candidates
        .iter()
        .position(|c| c.id.0 == id)
        .ok_or_else(|| ConfigError::UnknownCandidate {
            field,
            id: id.to_owned(),
            valid: candidates
                .iter()
                .map(|c| c.id.0.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}
