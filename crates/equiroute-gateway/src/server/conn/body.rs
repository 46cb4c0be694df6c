//! The bodies of one connection's requests and responses: a request body's bytes counted
//! against the buffered-bytes limits while they arrive (and why a body failed), and a
//! response body that holds a request's marks (in flight, a key's seat) until its last byte.

use crate::config::ConnectionLimits;
use crate::server::error::ApiError;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper::body::{Frame, Incoming, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};
use tokio::time::{Instant, Sleep};

use super::io::Activity;
use super::{take, AddressShare, ConnectionSlots};

/// Why a request's body could not be read to its end; the connection closes after the
/// answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum BodyFault {
    #[error("the request body did not arrive within server.body_read_timeout_ms")]
    TimedOut,
    #[error("the client address holds server.max_buffered_bytes_per_address")]
    AddressOverShare,
    #[error("the gateway holds server.max_buffered_bytes")]
    Overloaded,
}

impl BodyFault {
    /// The answer: a 408 for a body that did not arrive in time, a 429 when the address
    /// holds its share of the buffered bytes, a 503 when the gateway holds them all.
    pub(super) fn response(self, limits: &ConnectionLimits) -> Response {
        let error = match self {
            BodyFault::TimedOut => ApiError::invalid(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!(
                    "the request body did not arrive within {} ms (server.body_read_timeout_ms): send the whole body at once",
                    limits.body_read_timeout.as_millis()
                ),
            ),
            BodyFault::AddressOverShare => ApiError::busy(
                "too_many_buffered_bytes",
                format!(
                    "this client address has {} bytes of request bodies still arriving (server.max_buffered_bytes_per_address): send each body at once, or retry in a second",
                    limits.max_buffered_bytes_per_address
                ),
            ),
            BodyFault::Overloaded => ApiError {
                retry_after_s: Some(1),
                ..ApiError::upstream(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    format!(
                        "the gateway holds its maximum of {} bytes of request bodies still arriving (server.max_buffered_bytes): retry in a second",
                        limits.max_buffered_bytes
                    ),
                )
            },
        };
        let mut response = error.into_response();
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        response
    }
}

/// A request in flight on its connection, from its headers until its response is written
/// (or abandoned).
pub(super) struct InFlight(Arc<Activity>);

impl InFlight {
    pub(super) fn start(activity: Arc<Activity>) -> Self {
        activity.request_started();
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A response body that holds `G` (a request's seat among those in flight) until hyper
/// drops it (written or abandoned).
pub(in crate::server) struct HeldBody<G> {
    pub(super) body: Body,
    pub(super) _held: G,
}

impl<G: Send + Unpin + 'static> HeldBody<G> {
    /// `response` with its body holding `held` until it is dropped.
    pub(in crate::server) fn hold(response: Response, held: G) -> Response {
        response.map(|body| Body::new(HeldBody { body, _held: held }))
    }
}

impl<G: Send + Unpin + 'static> HttpBody for HeldBody<G> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The bytes of one request body received so far, counted against its address's
/// `max_buffered_bytes_per_address` and the gateway's `max_buffered_bytes` until the body
/// has all arrived (or is dropped, or fails).
pub(super) struct ArrivingBytes {
    pub(super) slots: Arc<ConnectionSlots>,
    pub(super) share: Arc<AddressShare>,
    pub(super) held: usize,
}

impl ArrivingBytes {
    /// Counts `n` more bytes, or says which limit they would pass (counting nothing).
    pub(super) fn grow(&mut self, n: usize) -> Result<(), BodyFault> {
        let limits = &self.slots.limits;
        if !take(
            &self.share.buffered,
            n,
            limits.max_buffered_bytes_per_address,
        ) {
            self.slots.refused.too_many_buffered_bytes.inc();
            return Err(BodyFault::AddressOverShare);
        }
        if !take(&self.slots.buffered, n, limits.max_buffered_bytes) {
            self.share.buffered.fetch_sub(n, Ordering::AcqRel);
            self.slots.refused.buffered_bytes_full.inc();
            return Err(BodyFault::Overloaded);
        }
        self.held += n;
        Ok(())
    }

    pub(super) fn release(&mut self) {
        let held = std::mem::take(&mut self.held);
        if held > 0 {
            self.share.buffered.fetch_sub(held, Ordering::AcqRel);
            self.slots.buffered.fetch_sub(held, Ordering::AcqRel);
        }
    }
}

impl Drop for ArrivingBytes {
    fn drop(&mut self) {
        self.release();
    }
}

/// A request body while it arrives: it fails once its deadline has passed or when its bytes
/// would pass a buffered-bytes limit, and says why in `fault`.
pub(super) struct ArrivingBody {
    pub(super) body: Incoming,
    pub(super) deadline: Instant,
    /// Armed on the first wait, so that a body already received costs no timer.
    pub(super) timer: Option<Pin<Box<Sleep>>>,
    pub(super) bytes: ArrivingBytes,
    pub(super) fault: Arc<OnceLock<BodyFault>>,
}

impl ArrivingBody {
    pub(super) fn fail(
        &mut self,
        fault: BodyFault,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        self.bytes.release();
        let _ = self.fault.set(fault);
        Poll::Ready(Some(Err(fault.into())))
    }
}

impl HttpBody for ArrivingBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            let arrived = match &frame {
                Some(Ok(frame)) => frame.data_ref().map_or(0, Bytes::len),
                Some(Err(_)) | None => 0,
            };
            if let Err(fault) = this.bytes.grow(arrived) {
                return this.fail(fault);
            }
            // All arrived: the bytes are the handler's now, bounded by `max_body_bytes` and
            // the connections, no longer held waiting for a slow client.
            if frame.is_none() || this.body.is_end_stream() {
                this.bytes.release();
            }
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        ready!(timer.as_mut().poll(cx));
        this.fail(BodyFault::TimedOut)
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
