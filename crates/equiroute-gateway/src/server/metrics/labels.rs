//! The label sets of the gateway's metric families: each a closed set of names, interned
//! (see `super::name`), so that nothing a client sends grows a family without a bound.

use super::Name;
use prometheus_client::encoding::EncodeLabelSet;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct InterfaceLabel {
    pub(super) interface: Name,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct OutcomeLabels {
    pub(super) interface: Name,
    pub(super) outcome: Name,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct AttemptLabels {
    pub(super) interface: Name,
    pub(super) provider: Name,
    pub(super) status: Name,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct EventLabels {
    pub(super) interface: Name,
    pub(super) event: Name,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReasonLabels {
    pub(super) interface: Name,
    pub(super) reason: Name,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ModeLabels {
    pub(super) interface: Name,
    pub(super) mode: Name,
}

/// A breaker transition's labels: provider ids repeat across interfaces, so the interface
/// is one.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct BreakerLabels {
    pub(super) interface: Name,
    pub(super) provider: Name,
    pub(super) to: Name,
}

/// A provider skipped for want of capacity, by the `limit` used up (`max_concurrency`,
/// `rpm`, `tpm`, `announced`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct LimitLabels {
    pub(super) interface: Name,
    pub(super) provider: Name,
    pub(super) limit: Name,
}

/// A quality shift's labels: `direction` is `down` or `up`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ShiftLabels {
    pub(super) interface: Name,
    pub(super) provider: Name,
    pub(super) direction: Name,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ProviderLabels {
    pub(super) interface: Name,
    pub(super) provider: Name,
}

/// A provider's token counts, by `token_type` (`input` or `output`, the OpenTelemetry
/// convention's `gen_ai.token.type`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct TokenLabels {
    pub(super) interface: Name,
    pub(super) provider: Name,
    pub(super) token_type: Name,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct FeedbackLabel {
    pub(super) outcome: Name,
}

/// A kind of repetitive log line (`Repeated::label` in the `repeated` module).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KindLabel {
    pub(super) kind: Name,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RefusalLabel {
    pub(super) reason: Name,
}
