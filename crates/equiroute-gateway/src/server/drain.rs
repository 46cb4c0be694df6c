//! The end of a drain: once `server.shutdown_grace_ms` has passed after a stop signal (or at
//! a second signal), every request still in flight is ended so that the gateway can save
//! its snapshot and exit. A stream (`text/event-stream`) ends with an OpenAI-shaped error
//! event (`code: "shutting_down"`), so that a client that joins deltas sees an error rather
//! than a clean end; a request still waiting for its answer gets a 503 with the same code;
//! any other body still being written is cut (the connection closes).
//!
//! The layer ([`layer`]) is the outermost of the router's: the cut reaches every route.

use super::error::ApiError;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::{Frame, SizeHint};
use std::future::Future;
use std::pin::Pin;
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

    /// Ends every request in flight through a [`layer`] of this cutoff, and every later one.
    pub fn cut(&self) {
        self.0.send_replace(true);
    }
}

impl Default for Cutoff {
    fn default() -> Self {
        Cutoff::new()
    }
}

/// `app` with its requests ended at `cutoff`.
pub fn layer(app: Router, cutoff: &Cutoff) -> Router {
    app.layer(middleware::from_fn_with_state(cutoff.0.subscribe(), cut))
}

/// Why a request was ended.
const MESSAGE: &str = "the gateway is shutting down and its grace period for requests in flight (server.shutdown_grace_ms) has passed: retry, another instance or the restarted gateway will answer";

type Cut = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Resolves once the cutoff is given (never if its sender is gone without giving it).
fn when_cut(mut rx: watch::Receiver<bool>) -> Cut {
    Box::pin(async move {
        if rx.wait_for(|cut| *cut).await.is_err() {
            std::future::pending::<()>().await;
        }
    })
}

fn error() -> ApiError {
    ApiError::upstream(StatusCode::SERVICE_UNAVAILABLE, "shutting_down", MESSAGE)
}

async fn cut(State(rx): State<watch::Receiver<bool>>, req: Request, next: Next) -> Response {
    let mut cut = when_cut(rx);
    let response = tokio::select! {
        response = next.run(req) => response,
        () = &mut cut => return error().into_response(),
    };
    let stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    response.map(|body| {
        Body::new(CutBody {
            body,
            cut,
            stream,
            ended: false,
        })
    })
}

/// A response body that ends at the cutoff: with an error event for a stream, with an error
/// (the connection closes) otherwise.
struct CutBody {
    body: Body,
    cut: Cut,
    stream: bool,
    ended: bool,
}

/// The cut of a body that is not a stream.
#[derive(Debug, thiserror::Error)]
#[error("{MESSAGE}")]
struct ShuttingDown;

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
        if this.cut.as_mut().poll(cx).is_ready() {
            this.ended = true;
            if this.stream {
                let event = format!("data: {}\n\n", error().body());
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))));
            }
            return Poll::Ready(Some(Err(axum::Error::new(ShuttingDown))));
        }
        Pin::new(&mut this.body).poll_frame(cx)
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
