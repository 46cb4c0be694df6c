//! Eligibility: the deterministic filters applied before any policy ranks. Capability,
//! tenant allow-lists, labels (e.g. data residency), quality gates, budget caps and circuit
//! breakers. Every excluded candidate carries a reason.

use crate::breaker::{Admission, Breaker, BreakerConfig};
use crate::decision::{Candidate, Requirements, Timestamp, TokenEstimate, Usd};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Why a candidate was not eligible for a request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum ExclusionReason {
    /// The request pinned another candidate.
    NotPinned,
    MissingCapability {
        capability: String,
    },
    ContextTooSmall {
        needed: u32,
        available: u32,
    },
    TenantNotAllowed {
        tenant: String,
    },
    /// The candidate serves only the tenants on its allow-list, and the request has none.
    TenantRequired,
    LabelMismatch {
        key: String,
        wanted: String,
        found: Option<String>,
    },
    QualityGate {
        estimate: f64,
        minimum: f64,
    },
    SpendCap {
        spent: f64,
        cap: f64,
    },
    RequestCostCap {
        expected: f64,
        cap: f64,
    },
    CircuitOpen {
        until: Option<Timestamp>,
    },
    /// The provider's API cannot express a member of the request (a native dialect without
    /// `logprobs`, say): another provider may; judged by the gateway, which knows the APIs.
    Inexpressible {
        field: String,
        why: String,
    },
}

impl fmt::Display for ExclusionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExclusionReason::NotPinned => write!(f, "the request pinned another candidate"),
            ExclusionReason::MissingCapability { capability } => {
                write!(f, "does not support {capability}")
            }
            ExclusionReason::ContextTooSmall { needed, available } => {
                write!(f, "context window {available} tokens < {needed} needed")
            }
            ExclusionReason::TenantNotAllowed { tenant } => {
                write!(f, "tenant `{tenant}` is not on its allow-list")
            }
            ExclusionReason::TenantRequired => {
                write!(
                    f,
                    "serves only the tenants on its allow-list and the request has none"
                )
            }
            ExclusionReason::LabelMismatch { key, wanted, found } => write!(
                f,
                "label `{key}` is {} but the request needs `{wanted}`",
                found
                    .as_deref()
                    .map_or("missing".to_owned(), |v| format!("`{v}`"))
            ),
            ExclusionReason::QualityGate { estimate, minimum } => {
                write!(
                    f,
                    "estimated quality {estimate:.3} below the gate {minimum:.3}"
                )
            }
            ExclusionReason::SpendCap { spent, cap } => {
                write!(f, "spent ${spent:.4} of its ${cap:.4} cap")
            }
            ExclusionReason::RequestCostCap { expected, cap } => {
                write!(
                    f,
                    "expected cost ${expected:.6} above the request's ${cap:.6} cap"
                )
            }
            ExclusionReason::CircuitOpen { .. } => write!(f, "circuit breaker open"),
            ExclusionReason::Inexpressible { field, why } => {
                write!(f, "its API cannot express `{field}`: {why}")
            }
        }
    }
}

/// One excluded candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Exclusion {
    pub candidate: usize,
    pub reason: ExclusionReason,
}

/// A quality gate: candidates with at least `min_observations` quality scores and a mean
/// below `min_quality` are excluded.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QualityGate {
    pub min_quality: f64,
    pub min_observations: u64,
}

/// Observed mean quality of a candidate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QualitySummary {
    pub mean: f64,
    pub observations: u64,
}

/// Everything eligibility looks at. Optional parts that are `None` do not filter.
#[derive(Clone, Copy, Debug)]
pub struct EligibilityInput<'a> {
    pub candidates: &'a [Candidate],
    pub requirements: &'a Requirements,
    /// The request's tenant. `None` is no tenant, not any: candidates with a `tenants`
    /// allow-list are then excluded ([`ExclusionReason::TenantRequired`]).
    pub tenant: Option<&'a str>,
    /// Labels the candidate must carry with these values (e.g. `region = eu`).
    pub required_labels: &'a [(String, String)],
    pub pinned: Option<usize>,
    pub breakers: Option<(&'a [Breaker], &'a BreakerConfig)>,
    /// Spend so far per candidate, compared with each candidate's `spend_cap`.
    pub spent: Option<&'a [Usd]>,
    pub quality: Option<(&'a [QualitySummary], QualityGate)>,
    /// The request's cost cap and token estimate.
    pub max_cost: Option<Usd>,
    pub tokens: TokenEstimate,
    pub now: Timestamp,
}

impl<'a> EligibilityInput<'a> {
    /// Input that only checks capabilities.
    #[must_use]
    pub fn new(candidates: &'a [Candidate], requirements: &'a Requirements) -> Self {
        EligibilityInput {
            candidates,
            requirements,
            tenant: None,
            required_labels: &[],
            pinned: None,
            breakers: None,
            spent: None,
            quality: None,
            max_cost: None,
            tokens: TokenEstimate::default(),
            now: Timestamp(0.0),
        }
    }
}

/// The result: eligible indices in configuration order, and the rest with reasons.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Eligible {
    pub eligible: Vec<usize>,
    pub excluded: Vec<Exclusion>,
}

impl Eligible {
    /// The last resort when nothing is eligible: of the candidates shut out only by a
    /// breaker that failures opened (not pinned by a `Retry-After`; breakers are checked
    /// last, so every other filter let them through), the one whose open period ends
    /// soonest. `None` when something is eligible, when `cfg.last_resort` is off, or when no
    /// such candidate exists (every open breaker pinned, or half-open with its probes out).
    #[must_use]
    pub fn last_resort(&self, breakers: &[Breaker], cfg: &BreakerConfig) -> Option<usize> {
        if !self.eligible.is_empty() || !cfg.last_resort {
            return None;
        }
        self.excluded
            .iter()
            .filter_map(|e| match e.reason {
                ExclusionReason::CircuitOpen { until: Some(until) }
                    if breakers.get(e.candidate).is_some_and(|b| !b.is_pinned()) =>
                {
                    Some((e.candidate, until))
                }
                _ => None,
            })
            .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0))
            .map(|(candidate, _)| candidate)
    }
}

/// Applies every filter; a candidate gets the first reason that excludes it.
#[must_use]
pub fn check_eligibility(input: &EligibilityInput<'_>) -> Eligible {
    let mut out = Eligible::default();
    for (i, c) in input.candidates.iter().enumerate() {
        match exclusion(input, i, c) {
            None => out.eligible.push(i),
            Some(reason) => out.excluded.push(Exclusion {
                candidate: i,
                reason,
            }),
        }
    }
    out
}

fn exclusion(input: &EligibilityInput<'_>, i: usize, c: &Candidate) -> Option<ExclusionReason> {
    if input.pinned.is_some_and(|p| p != i) {
        return Some(ExclusionReason::NotPinned);
    }
    let req = input.requirements;
    let caps = &c.capabilities;
    for (needed, has, name) in [
        (req.tools, caps.tools, "tools"),
        (req.json_mode, caps.json_mode, "JSON mode"),
        (req.streaming, caps.streaming, "streaming"),
        (req.vision, caps.vision, "image input"),
        (req.audio, caps.audio, "audio input"),
    ] {
        if needed && !has {
            return Some(ExclusionReason::MissingCapability {
                capability: name.to_owned(),
            });
        }
    }
    if req.context_tokens > caps.context_tokens {
        return Some(ExclusionReason::ContextTooSmall {
            needed: req.context_tokens,
            available: caps.context_tokens,
        });
    }
    // A candidate restricted to tenants never serves a request without one: a missing
    // tenant is not a wildcard.
    if let Some(allowed) = &c.tenants {
        match input.tenant {
            None => return Some(ExclusionReason::TenantRequired),
            Some(tenant) if !allowed.iter().any(|t| t == tenant) => {
                return Some(ExclusionReason::TenantNotAllowed {
                    tenant: tenant.to_owned(),
                });
            }
            Some(_) => {}
        }
    }
    for (key, wanted) in input.required_labels {
        let found = c.labels.get(key);
        if found != Some(wanted) {
            return Some(ExclusionReason::LabelMismatch {
                key: key.clone(),
                wanted: wanted.clone(),
                found: found.cloned(),
            });
        }
    }
    if let Some((summaries, gate)) = input.quality {
        if let Some(q) = summaries.get(i) {
            if q.observations >= gate.min_observations && q.mean < gate.min_quality {
                return Some(ExclusionReason::QualityGate {
                    estimate: q.mean,
                    minimum: gate.min_quality,
                });
            }
        }
    }
    if let (Some(spent), Some(cap)) = (input.spent.and_then(|s| s.get(i)), c.spend_cap) {
        if spent.0 >= cap.0 {
            return Some(ExclusionReason::SpendCap {
                spent: spent.0,
                cap: cap.0,
            });
        }
    }
    if let Some(cap) = input.max_cost {
        let expected = c.price.cost(input.tokens).0;
        if expected > cap.0 {
            return Some(ExclusionReason::RequestCostCap {
                expected,
                cap: cap.0,
            });
        }
    }
    if let Some((breakers, cfg)) = input.breakers {
        if let Some(Admission::Rejected { until }) = breakers.get(i).map(|b| b.peek(input.now, cfg))
        {
            return Some(ExclusionReason::CircuitOpen { until });
        }
    }
    None
}
