//! The spans of a request: `request` around it, and as its children one `decision` and one
//! `attempt` per upstream attempt, all debug. Field names follow OpenTelemetry's
//! semantic conventions for generative AI (`gen_ai.*`); the routing decision is under
//! `equiroute.*`. docs/operations.md lists them.
//!
//! They are disabled (free: no field is evaluated) unless `RUST_LOG` asks for debug or
//! `[telemetry]` exports traces (at `info` a request span would be built and its fields
//! formatted by the logs for every request, although no line of a request that goes well is
//! written at `info`, and its error lines name their `request_id` themselves); the strings of
//! a decision are built only when its span is enabled. No field carries a prompt, an answer or
//! a key.

use super::state::InterfaceRuntime;
use crate::config::InterfaceKind;
use equiroute_core::executor::{NextAttempt, RequestResult, RetryReason};
use equiroute_core::{AttemptOutcome, AttemptStatus, TokenEstimate};
use std::fmt::Write as _;
use tracing::field::Empty;

/// `gen_ai.operation.name` of an interface's requests.
fn operation(iface: &InterfaceRuntime) -> &'static str {
    match iface.kind {
        InterfaceKind::Chat => "chat",
        InterfaceKind::Tool => "execute_tool",
    }
}

/// The span around one request's handling; its id is recorded once it is numbered.
pub(super) fn request(iface: &InterfaceRuntime) -> tracing::Span {
    tracing::debug_span!(
        "request",
        request_id = Empty,
        interface = %iface.name,
        gen_ai.operation.name = operation(iface),
        gen_ai.request.model = %iface.name,
        gen_ai.response.model = Empty,
        gen_ai.provider.name = Empty,
        equiroute.outcome = Empty,
        equiroute.attempts = Empty,
        equiroute.fallback_reason = Empty,
        equiroute.cost_usd = Empty,
        otel.status_code = Empty,
    )
}

/// Records how a request ended on its span (the current one), when traces are exported.
pub(super) fn finish_request(
    iface: &InterfaceRuntime,
    result: &RequestResult,
    outcome: &'static str,
    fallback_reason: Option<&str>,
) {
    let span = tracing::Span::current();
    if span.is_disabled() || !crate::telemetry::exporting() {
        return;
    }
    if let equiroute_core::executor::RequestStatus::Succeeded { candidate } = result.status {
        span.record(
            "gen_ai.response.model",
            iface.candidates[candidate].model.as_str(),
        );
        span.record("gen_ai.provider.name", iface.upstreams[candidate].system());
    } else {
        span.record("otel.status_code", "ERROR");
    }
    span.record("equiroute.outcome", outcome);
    span.record(
        "equiroute.attempts",
        i64::try_from(result.attempts.len()).unwrap_or(i64::MAX),
    );
    span.record("equiroute.cost_usd", result.cost.0);
    if let Some(reason) = fallback_reason {
        span.record("equiroute.fallback_reason", reason);
    }
}

/// The span of a request's decision (eligibility and ranking), filled by [`record_decision`].
pub(super) fn decision() -> tracing::Span {
    tracing::debug_span!(
        "decision",
        equiroute.policy = Empty,
        equiroute.candidates = Empty,
        equiroute.eligible = Empty,
        equiroute.excluded = Empty,
        equiroute.scores = Empty,
        equiroute.chosen = Empty,
        equiroute.propensity = Empty,
        equiroute.propensity_kind = Empty,
        equiroute.last_resort = Empty,
        equiroute.hedge_delay_ms = Empty,
        otel.status_code = Empty,
    )
}

/// What [`record_decision`] reads of a decision.
pub(super) struct DecisionView<'a> {
    pub policy: &'static str,
    pub eligible: &'a [usize],
    pub excluded: &'a [equiroute_core::eligibility::Exclusion],
    pub ranking: &'a equiroute_core::policies::Ranking,
    pub last_resort: bool,
    pub hedge_delay: Option<f64>,
}

/// Fills the decision span: the candidates, the eligible ones, the excluded ones with their
/// reasons (`id: reason; …`), the scores in ranking order (`id=score,…`), the first choice and
/// its probability. Nothing is built when the span is disabled.
pub(super) fn record_decision(span: &tracing::Span, iface: &InterfaceRuntime, d: &DecisionView) {
    if span.is_disabled() {
        return;
    }
    let id = |i: usize| iface.candidates[i].id.0.as_str();
    let join = |ids: &mut dyn Iterator<Item = usize>| {
        let mut s = String::new();
        for (n, i) in ids.enumerate() {
            if n > 0 {
                s.push(',');
            }
            s.push_str(id(i));
        }
        s
    };
    span.record("equiroute.policy", d.policy);
    span.record(
        "equiroute.candidates",
        join(&mut (0..iface.candidates.len())).as_str(),
    );
    span.record(
        "equiroute.eligible",
        join(&mut d.eligible.iter().copied()).as_str(),
    );
    if !d.excluded.is_empty() {
        let mut s = String::new();
        for (n, e) in d.excluded.iter().enumerate() {
            let reason = e.reason.to_string();
            // A reason may quote the client's tenant header: cut like any echoed input.
            let _ = write!(
                s,
                "{}{}: {}",
                if n > 0 { "; " } else { "" },
                id(e.candidate),
                super::error::echo(&reason)
            );
        }
        span.record("equiroute.excluded", s.as_str());
    }
    let mut scores = String::new();
    for (n, s) in d.ranking.order.iter().enumerate() {
        let _ = write!(
            scores,
            "{}{}={:.6}",
            if n > 0 { "," } else { "" },
            id(s.index),
            s.score
        );
    }
    span.record("equiroute.scores", scores.as_str());
    if let Some(first) = d.ranking.order.first() {
        span.record("equiroute.chosen", id(first.index));
    }
    if let Some(p) = d.ranking.propensity {
        span.record("equiroute.propensity", p.probability);
        span.record("equiroute.propensity_kind", p.kind_name());
    }
    span.record("equiroute.last_resort", d.last_resort);
    if let Some(ms) = d.hedge_delay {
        span.record("equiroute.hedge_delay_ms", ms);
    }
}

/// The span of one upstream attempt, filled by [`record_attempt`] when it ends.
pub(super) fn attempt(iface: &InterfaceRuntime, next: NextAttempt, hedge: bool) -> tracing::Span {
    let c = &iface.candidates[next.candidate];
    tracing::debug_span!(
        "attempt",
        gen_ai.operation.name = operation(iface),
        gen_ai.provider.name = iface.upstreams[next.candidate].system(),
        gen_ai.request.model = %c.model,
        gen_ai.response.model = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        equiroute.provider = %c.id,
        equiroute.attempt = i64::from(next.number),
        equiroute.retry = next.retry.map(RetryReason::as_str),
        equiroute.hedge = hedge,
        equiroute.outcome = Empty,
        equiroute.latency_ms = Empty,
        equiroute.ttfb_ms = Empty,
        equiroute.cost_usd = Empty,
        otel.kind = "client",
        otel.status_code = Empty,
    )
}

// Integers are recorded as i64: OpenTelemetry has no unsigned type, and the layer exports a
// u64 as a string.

/// Records an attempt's outcome on its span; `usage` is the provider's reported token usage.
pub(super) fn record_attempt(
    span: &tracing::Span,
    iface: &InterfaceRuntime,
    candidate: usize,
    outcome: &AttemptOutcome,
    usage: Option<TokenEstimate>,
) {
    if span.is_disabled() {
        return;
    }
    span.record("equiroute.outcome", outcome.status.as_str());
    span.record("equiroute.latency_ms", outcome.latency.0);
    span.record("equiroute.cost_usd", outcome.cost.0);
    if let Some(t) = outcome.time_to_first_byte {
        span.record("equiroute.ttfb_ms", t.0);
    }
    if outcome.status == AttemptStatus::Ok {
        span.record(
            "gen_ai.response.model",
            iface.candidates[candidate].model.as_str(),
        );
    } else {
        span.record("otel.status_code", "ERROR");
    }
    if let Some(u) = usage {
        span.record("gen_ai.usage.input_tokens", i64::from(u.input));
        span.record("gen_ai.usage.output_tokens", i64::from(u.output));
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::Layer as _;

    /// The logs' subscriber at `level` (`equiroute`'s, without an exporter), and whether a
    /// request's span is enabled under it.
    fn request_span_enabled(level: &str) -> bool {
        let state = super::super::state::tests::app_seeded(1);
        let iface = state.interface("chat").unwrap_or_else(|| panic!("no chat"));
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::sink)
            .with_filter(tracing_subscriber::EnvFilter::new(level));
        let subscriber = tracing_subscriber::registry().with(logs);
        tracing::subscriber::with_default(subscriber, || !super::request(&iface).is_disabled())
    }

    #[test]
    fn a_request_span_is_built_only_where_the_logs_take_debug() {
        // At the default level no span is built per request (issue 45: a span without an
        // exporter costs nothing); at debug it carries the request's lines.
        assert!(!request_span_enabled("info"));
        assert!(!request_span_enabled("warn"));
        assert!(request_span_enabled("debug"));
        assert!(request_span_enabled("info,equiroute_gateway=debug"));
    }
}
