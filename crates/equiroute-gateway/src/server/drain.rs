//! The end of a drain: once `server.shutdown_grace_ms` has passed after a stop signal (or at
//! a second signal), every request still in flight is ended so that the gateway can save
//! its snapshot and exit. A stream (`text/event-stream`) ends with an OpenAI-shaped error
//! event (`code: "shutting_down"`), so that a client that joins deltas sees an error rather
//! than a clean end; a request still waiting for its answer gets a 503 with the same code;
//! any other body still being written is cut (the connection closes).
//!
//! Each connection's handler ([`super::conn`]) runs its requests through [`until_cut`]: the cut
//! reaches every route. Until the cutoff it costs a request no allocation: the wait for it
//! borrows the handler's receiver, and a body that never waits never registers.

use super::error::ApiError;
use super::lookout::Lookout;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper::body::{Frame, SizeHint};
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::task::{Context, Poll};
use tokio::sync::watch;

/// Ends what is in flight when told: [`Cutoff::cut`].
#[derive(Debug)]
pub struct Cutoff(watch::Sender<bool>);

impl Cutoff {
    /// A cutoff not yet given.
    #[must_use]
    pub fn new() -> Self {
        Cutoff(watch::channel(false).0)
    }

    /// Ends every request in flight through [`until_cut`] with this cutoff's receiver, and
    /// every later one.
    pub fn cut(&self) {
        self.0.send_replace(true);
    }

    /// What a connection's handler watches to end its requests at the cutoff.
    pub(super) fn receiver(&self) -> watch::Receiver<bool> {
        self.0.subscribe()
    }
}

impl Default for Cutoff {
    fn default() -> Self {
        Cutoff::new()
    }
}

/// Why a request was ended.
const MESSAGE: &str = "the gateway is shutting down and its grace period for requests in flight (server.shutdown_grace_ms) has passed: retry, another instance or the restarted gateway will answer";

type Cut = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Resolves once the cutoff is given (never if its sender is gone without giving it).
async fn given(rx: &mut watch::Receiver<bool>) {
    if rx.wait_for(|cut| *cut).await.is_err() {
        std::future::pending::<()>().await;
    }
}

fn error() -> ApiError {
    ApiError::upstream(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", MESSAGE)
}

/// The response `answer` gives, or a 503 (`shutting_down`) if the cutoff of `rx` comes
/// first; a body still being written at the cutoff ends there (see [`CutBody`]). The cutoff
/// is looked at when it woke the request's task ([`Lookout`]), not on each of its wake-ups.
pub(super) async fn until_cut(
    mut rx: watch::Receiver<bool>,
    answer: impl Future<Output = Response>,
) -> Response {
    let answered = {
        let lookout = Lookout::new();
        let mut answer = pin!(answer);
        let mut cut = pin!(given(&mut rx));
        poll_fn(|cx| match answer.as_mut().poll(cx) {
            Poll::Ready(response) => Poll::Ready(Some(response)),
            Poll::Pending if lookout.due(cx) && lookout.ready(cut.as_mut()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        })
        .await
    };
    let Some(response) = answered else {
        return error().into_response();
    };
    let stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    response.map(|body| {
        Body::new(CutBody {
            body,
            rx,
            cut: None,
            stream,
            ended: false,
        })
    })
}

/// A response body that ends at the cutoff: with an error event for a stream, with an error
/// (the connection closes) otherwise.
struct CutBody {
    body: Body,
    rx: watch::Receiver<bool>,
    /// The wait for the cutoff, made the first time the body waits (a body that is ready
    /// whenever it is polled never needs it).
    cut: Option<Cut>,
    stream: bool,
    ended: bool,
}

/// The cut of a body that is not a stream.
#[derive(Debug, thiserror::Error)]
#[error("{MESSAGE}")]
struct ShuttingDown;

impl CutBody {
    /// The body's last frame at the cutoff: an error event for a stream, an error otherwise.
    fn end(&mut self) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.ended = true;
        if self.stream {
            let event = format!("data: {}\n\n", error().body());
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))));
        }
        Poll::Ready(Some(Err(axum::Error::new(ShuttingDown))))
    }
}

impl HttpBody for CutBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        // The cutoff first: a stream that never pauses is cut all the same.
        if *this.rx.borrow() {
            return this.end();
        }
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if frame.is_pending() {
            let rx = &this.rx;
            let cut = this.cut.get_or_insert_with(|| {
                let mut rx = rx.clone();
                Box::pin(async move { given(&mut rx).await })
            });
            if cut.as_mut().poll(cx).is_ready() {
                return this.end();
            }
        }
        frame
    }
    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        if self.stream {
            SizeHint::default()
        } else {
            self.body.size_hint()
        }
    }
}
