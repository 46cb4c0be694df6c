//! The key's gate of a group of routes ([`KeyGate`]): a request whose key opens the route
//! goes on with its [`auth::Caller`] as an extension; a traffic request also holds a seat
//! among its key's requests in flight until its answer's last byte (a stream's too). Any
//! other request gets the 401 that names the setting holding the route's keys.
//!
//! A tower layer of its own rather than `axum::middleware::from_fn`: that one boxes the
//! inner service and the future of every request; this one allocates nothing.

use super::auth::{self, KeySeat};
use super::conn::HeldBody;
use super::error::ApiError;
use super::state::AppState;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// The gate of the routes whose keys are `route`'s.
#[derive(Clone)]
pub(super) struct KeyGate {
    state: Arc<AppState>,
    route: auth::Route,
    /// The key may come as `x-api-key` (Anthropic's clients send it so): `/v1/messages` only.
    x_api_key: bool,
}

impl KeyGate {
    pub(super) fn new(state: &Arc<AppState>, route: auth::Route) -> KeyGate {
        KeyGate {
            state: state.clone(),
            route,
            x_api_key: false,
        }
    }

    /// The gate of `/v1/messages`: the traffic keys, also as `x-api-key`.
    pub(super) fn messages(state: &Arc<AppState>) -> KeyGate {
        KeyGate {
            x_api_key: true,
            ..KeyGate::new(state, auth::Route::Traffic)
        }
    }

    /// Lets `req` in (its caller inserted, with its seat for a traffic request), or the
    /// error that refuses it.
    fn admit(&self, req: &mut Request) -> Result<Option<KeySeat>, ApiError> {
        let keys = &self.state.keys;
        let Some(caller) = keys.caller(req.headers(), self.route, self.x_api_key) else {
            return Err(match self.route {
                auth::Route::Admin => ApiError::unauthorized_admin(keys.has_admin_keys()),
                auth::Route::Traffic | auth::Route::Feedback => ApiError::unauthorized(),
            });
        };
        let seat = match self.route {
            auth::Route::Traffic => keys.enter(&caller)?,
            auth::Route::Feedback | auth::Route::Admin => None,
        };
        req.extensions_mut().insert(caller);
        Ok(seat)
    }
}

impl<S> tower_layer::Layer<S> for KeyGate {
    type Service = Gated<S>;

    fn layer(&self, inner: S) -> Gated<S> {
        Gated {
            gate: self.clone(),
            inner,
        }
    }
}

/// Routes behind a [`KeyGate`].
#[derive(Clone)]
pub(super) struct Gated<S> {
    gate: KeyGate,
    inner: S,
}

impl<S> tower_service::Service<Request> for Gated<S>
where
    S: tower_service::Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Admitted<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        match self.gate.admit(&mut req) {
            Ok(seat) => Admitted::In {
                answer: self.inner.call(req),
                seat,
            },
            Err(refusal) => Admitted::Refused {
                refusal: Some(refusal.into_response()),
            },
        }
    }
}

pin_project_lite::pin_project! {
    /// The answer of a request at the gate: the route's, holding the key's seat, or the
    /// refusal.
    #[project = AdmittedProj]
    pub(super) enum Admitted<F> {
        In { #[pin] answer: F, seat: Option<KeySeat> },
        Refused { refusal: Option<Response> },
    }
}

impl<F: Future<Output = Result<Response, Infallible>>> Future for Admitted<F> {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            AdmittedProj::In { answer, seat } => {
                let Ok(response) = std::task::ready!(answer.poll(cx));
                Poll::Ready(Ok(match seat.take() {
                    Some(seat) => HeldBody::hold(response, seat),
                    None => response,
                }))
            }
            // Taken once: hyper never polls an answer again after it is ready.
            AdmittedProj::Refused { refusal } => Poll::Ready(Ok(refusal
                .take()
                .unwrap_or_else(|| ApiError::internal().into_response()))),
        }
    }
}
