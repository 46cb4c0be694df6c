//! A provider's 4xx that its peers do not give: a second opinion, and the demotion of a
//! provider whose rejections another provider disputes.
//!
//! A plain rejection (a 4xx other than 429, not a content filter's refusal and not a context
//! window's, which have rules of their own) may be about the request (a malformed message:
//! every provider would refuse it) or about the provider (a wrong or deprecated model name, a
//! revoked or wrong-project key, a parameter its model does not take). The gateway cannot
//! tell them apart from one answer, so it asks a second opinion: the request's first plain
//! rejection continues the request on the untried candidates of its ranking, within its
//! deadline and `max_attempts`.
//!
//! - Another provider answers: the rejection was the provider's. The client gets the answer,
//!   and the rejecting provider is charged a failure on its breaker (counted in
//!   `equiroute_rejections_disputed_total`): a provider that rejects what its peers accept
//!   is demoted as one that fails is, its breaker opening after `consecutive_failures` such
//!   rejections in a row (a warning says so), then probed with the breaker's back-off.
//! - Another provider rejects it too: the request's own. Its 400 goes back, and nothing is
//!   counted against either provider: a client's mistakes never demote a provider.
//! - No other provider answers (none left, errors, the deadline): the first rejection goes
//!   back, as it would have without the second opinion.
//!
//! The cost: a request the client got wrong takes two upstream calls (both 4xx, which
//! providers do not bill) and one more round trip before its 400.

use super::state::{AppState, InterfaceRuntime};
use crate::upstream::UpstreamReply;
use equiroute_core::executor::{Execution, RequestResult, RequestStatus};
use equiroute_core::AttemptStatus;

/// The first plain rejection of one request, and the reply that carried it.
#[derive(Default)]
pub(super) struct Rejections {
    first: Option<(usize, UpstreamReply)>,
}

impl Rejections {
    /// After `candidate`'s attempt ended with `reply`: the request's first plain rejection
    /// continues the request with the untried candidates of `order` (`tried` so far).
    pub(super) fn after_attempt(
        &mut self,
        order: &[usize],
        tried: &[usize],
        candidate: usize,
        reply: &UpstreamReply,
        run: &mut Execution,
    ) {
        let plain = reply.status == AttemptStatus::ClientError
            && !reply.content_filter
            && !reply.context_overflow;
        if !plain || self.first.is_some() {
            return;
        }
        self.first = Some((candidate, reply.clone()));
        let untried: Vec<usize> = order
            .iter()
            .copied()
            .filter(|i| !tried.contains(i))
            .collect();
        if !untried.is_empty() {
            run.continue_with(untried);
        }
    }

    /// `candidate` answered the request: a rejection of it by another provider was that
    /// provider's, and is charged to it.
    pub(super) fn answered(&self, state: &AppState, iface: &InterfaceRuntime, candidate: usize) {
        let Some((index, _)) = self.first else {
            return;
        };
        if index == candidate {
            return;
        }
        let (rejecter, answerer) = (&iface.candidates[index].id, &iface.candidates[candidate].id);
        state.metrics.rejection_disputed(&iface.name, &rejecter.0);
        match state.ledger(iface).count_failure(index) {
            // Once per opening of its breaker: bounded by the open periods, whatever clients send.
            Ok(Some(until)) => tracing::warn!(
                interface = %iface.name,
                provider = %rejecter,
                answered_by = %answerer,
                open_ms = until.0 - state.now().0,
                "a provider rejected (4xx) requests that another provider answered: its breaker is open, it is demoted until its probes succeed"
            ),
            Ok(None) => tracing::debug!(
                interface = %iface.name,
                provider = %rejecter,
                answered_by = %answerer,
                "a provider's rejection was disputed: counted against its breaker"
            ),
            // A poisoned lock: the request has its answer; the next one reports it.
            Err(_) => {}
        }
    }

    /// The request is over with `result`: an answer disputes the rejection; without one,
    /// the rejection goes back to the client (with `last`, the reply its error quotes),
    /// as it would have without the second opinion.
    pub(super) fn settle(
        self,
        state: &AppState,
        iface: &InterfaceRuntime,
        result: &mut RequestResult,
        last: &mut Option<UpstreamReply>,
    ) {
        match result.status {
            RequestStatus::Succeeded { candidate } => self.answered(state, iface, candidate),
            RequestStatus::Exhausted | RequestStatus::DeadlineExceeded => {
                if let Some((rejecter, reply)) = self.first {
                    result.status = RequestStatus::ClientError {
                        candidate: rejecter,
                    };
                    *last = Some(reply);
                }
            }
            // Rejected again: the request's own.
            RequestStatus::ClientError { .. } => {}
        }
    }
}
