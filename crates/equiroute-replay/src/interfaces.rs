//! Each interface's log in its index space: the candidates (from the configuration, else the
//! log's ids), each request as a decision, and the decisions, attempts and scores in time
//! order.

use crate::log::Joined;
use equiroute_core::policies::PolicyConfig;
use equiroute_core::{AttemptOutcome, Candidate, Millis, SlicePath, TokenEstimate};
use std::collections::BTreeMap;

/// Where an interface's candidates came from.
#[derive(Clone, Debug)]
pub(crate) enum CandidatesFrom {
    /// The configuration file (or `embedded default`).
    Config(String),
    /// The log alone: ids only, prices unknown (0).
    Log,
}

impl CandidatesFrom {
    pub(crate) fn describe(&self) -> String {
        match self {
            CandidatesFrom::Config(name) => format!("candidates from {name}"),
            CandidatesFrom::Log => {
                "candidates from the log alone (prices unknown: counted as 0)".into()
            }
        }
    }
}

/// One interface's candidates, and what the configuration says of it.
pub(crate) struct Space {
    pub(crate) candidates: Vec<Candidate>,
    pub(crate) from: CandidatesFrom,
    pub(crate) policy: Option<PolicyConfig>,
    pub(crate) feature_dim: usize,
}

impl Space {
    pub(crate) fn index(&self, id: &str) -> Option<usize> {
        self.candidates.iter().position(|c| c.id.0 == id)
    }
}

/// How the logging policy's propensity is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Known {
    Exact,
    Estimated,
    Deterministic,
}

/// One logged decision, in the interface's index space.
pub(crate) struct Decision {
    pub(crate) decided: f64,
    pub(crate) eligible: Vec<usize>,
    pub(crate) action: usize,
    /// The logging policy's probability of `action`, when it reported a usable one.
    pub(crate) propensity: Option<(f64, Known)>,
    pub(crate) features: Option<Vec<f64>>,
    pub(crate) slice: SlicePath,
    pub(crate) tokens: TokenEstimate,
    pub(crate) deadline: Option<Millis>,
    /// (candidate, outcome, start).
    pub(crate) attempts: Vec<(usize, AttemptOutcome, f64)>,
    pub(crate) answered_by: Option<usize>,
    pub(crate) latency: f64,
    pub(crate) quality: Option<(f64, f64)>,
    pub(crate) miss: bool,
    pub(crate) bad: bool,
    pub(crate) cost: f64,
}

/// What happens, in time order, during a replay.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Event {
    Decide(usize),
    Attempt(usize, usize),
    Feedback(usize),
}

/// One interface's log, ready to replay.
pub(crate) struct InterfaceLog {
    pub(crate) name: String,
    pub(crate) space: Space,
    pub(crate) decisions: Vec<Decision>,
    pub(crate) events: Vec<Event>,
    pub(crate) logging_policies: Vec<String>,
    pub(crate) features: BTreeMap<&'static str, usize>,
    /// Requests whose providers the configuration does not have.
    pub(crate) unknown_provider: usize,
    /// Requests whose logging policy reported no usable propensity.
    pub(crate) no_propensity: usize,
}

/// The requests of each interface, in its index space.
pub(crate) fn split(
    requests: &[Joined],
    config: &equiroute_gateway::config::GatewayConfig,
    config_name: &str,
) -> Vec<InterfaceLog> {
    let mut by_name: BTreeMap<&str, Vec<&Joined>> = BTreeMap::new();
    for j in requests {
        by_name.entry(&j.request.interface).or_default().push(j);
    }
    by_name
        .into_iter()
        .map(|(name, reqs)| interface_log(name, &reqs, config, config_name))
        .collect()
}

pub(crate) fn space(
    name: &str,
    requests: &[&Joined],
    config: &equiroute_gateway::config::GatewayConfig,
    config_name: &str,
) -> Space {
    let logged_dim = requests
        .iter()
        .find_map(|j| j.request.features.as_ref().map(Vec::len));
    if let Some(iface) = config.interfaces.iter().find(|i| i.name == name) {
        return Space {
            candidates: iface
                .providers
                .iter()
                .map(|p| p.candidate.clone())
                .collect(),
            from: CandidatesFrom::Config(config_name.to_owned()),
            policy: Some(iface.policy.clone()),
            feature_dim: logged_dim.unwrap_or(iface.feature_dim),
        };
    }
    // The newest record's list: the gateway's last configuration.
    let ids = requests
        .iter()
        .max_by(|a, b| a.request.ts_ms.total_cmp(&b.request.ts_ms))
        .map(|j| j.request.candidates.clone())
        .unwrap_or_default();
    Space {
        candidates: ids.iter().map(|id| Candidate::new(id, id, "")).collect(),
        from: CandidatesFrom::Log,
        policy: None,
        feature_dim: logged_dim.unwrap_or(64),
    }
}

pub(crate) fn interface_log(
    name: &str,
    requests: &[&Joined],
    config: &equiroute_gateway::config::GatewayConfig,
    config_name: &str,
) -> InterfaceLog {
    let space = space(name, requests, config, config_name);
    let mut out = InterfaceLog {
        name: name.to_owned(),
        decisions: Vec::new(),
        events: Vec::new(),
        logging_policies: Vec::new(),
        features: BTreeMap::new(),
        unknown_provider: 0,
        no_propensity: 0,
        space,
    };
    for j in requests {
        let r = &j.request;
        if !out.logging_policies.contains(&r.policy) {
            out.logging_policies.push(r.policy.clone());
        }
        *out.features.entry(r.features_kept().as_str()).or_default() += 1;
        let Some(d) = decision(j, &out.space) else {
            out.unknown_provider += 1;
            continue;
        };
        if d.propensity.is_none() {
            out.no_propensity += 1;
        }
        out.decisions.push(d);
    }
    out.events = events(&out.decisions);
    out
}

/// A request in the index space of `space`; `None` when it names a provider `space` lacks.
pub(crate) fn decision(j: &Joined, space: &Space) -> Option<Decision> {
    let r = &j.request;
    let mut eligible: Vec<usize> = r
        .eligible()
        .iter()
        .map(|id| space.index(id))
        .collect::<Option<_>>()?;
    eligible.sort_unstable();
    eligible.dedup();
    let action = space.index(r.order.first()?)?;
    if !eligible.contains(&action) {
        eligible.push(action);
        eligible.sort_unstable();
    }
    let decided = r.decided_ms();
    let attempts = r
        .attempts
        .iter()
        .map(|a| Some((space.index(&a.provider)?, a.outcome(), a.started(decided))))
        .collect::<Option<Vec<_>>>()?;
    let known = match r.propensity_kind.as_deref() {
        Some("exact") => Known::Exact,
        Some("estimated") => Known::Estimated,
        Some(_) => Known::Deterministic,
        // Logs written before the kind: 1 is a deterministic policy's, anything else exact.
        None if r.propensity == Some(1.0) => Known::Deterministic,
        None => Known::Exact,
    };
    Some(Decision {
        decided,
        eligible,
        action,
        propensity: r.propensity.filter(|p| *p > 0.0).map(|p| (p, known)),
        features: r.features.clone(),
        slice: r.slice.unwrap_or_default(),
        tokens: r.tokens.unwrap_or_default(),
        deadline: r.deadline_ms.map(Millis),
        attempts,
        answered_by: r.answered_by().and_then(|id| space.index(id)),
        latency: r.latency_ms,
        quality: j.quality.zip(j.feedback_ms),
        miss: r.deadline_miss(),
        bad: r.bad(),
        cost: r.cost_usd,
    })
}

/// Decisions, attempts (at their end) and scores, in time order; a decision before its own
/// attempts.
pub(crate) fn events(decisions: &[Decision]) -> Vec<Event> {
    let mut timed: Vec<(f64, u8, Event)> = Vec::new();
    for (i, d) in decisions.iter().enumerate() {
        timed.push((d.decided, 0, Event::Decide(i)));
        for (k, (_, outcome, started)) in d.attempts.iter().enumerate() {
            let end = (started + outcome.latency.0).max(d.decided);
            timed.push((end, 1, Event::Attempt(i, k)));
        }
        if let (Some((_, at)), Some(_)) = (d.quality, d.answered_by) {
            timed.push((at, 2, Event::Feedback(i)));
        }
    }
    timed.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    timed.into_iter().map(|(_, _, e)| e).collect()
}
