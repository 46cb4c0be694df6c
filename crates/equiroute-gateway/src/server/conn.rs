//! The accept loop and the life of each connection; every event loop serves its listening
//! socket with [`serve`], so the limits below hold alike on all of them.
//!
//! A client cannot hold a connection for ever: a request's headers must arrive within
//! `header_read_timeout` (counted from the accept, or from the first byte after an idle
//! spell), its body within `body_read_timeout` (else a 408 and the connection is closed), and
//! a keep-alive connection with no request in flight is closed after `idle_timeout`. A
//! response still being written (a streamed answer included) is in flight, so the idle
//! timeout never cuts it. At most `max_connections` connections are served at once over every
//! event loop; beyond, a new connection gets a raw 503 with `Retry-After: 1` and is closed
//! without being served.
//!
//! A write to a client that does not read (its socket stays full) fails after `send_timeout`
//! without progress: the connection closes, and with it the response (a relayed stream
//! ends, which cancels its upstream call).
//!
//! Hyper's own `header_read_timeout` is not used: it also runs while a keep-alive connection
//! waits for its next request, so it would close idle connections at the header timeout
//! instead of the idle one.

use super::error::ApiError;
use crate::config::ConnectionLimits;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{header, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::{Instant, Sleep};

/// How long a refused connection is kept to deliver its 503 and read what the client sent
/// meanwhile (closing with unread bytes would reset the connection and lose the 503).
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// The pause after an accept error other than a client's (most likely out of file
/// descriptors): open connections get a moment to close.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// The connections open over every event loop of a gateway, against `max_connections`.
#[derive(Debug)]
pub struct ConnectionSlots {
    served: Arc<Counter>,
    /// Refused connections lingering to deliver their 503, bounded by `max_connections`
    /// too; past that a refusal is written without waiting and the socket closed at once.
    refusing: Arc<Counter>,
    /// The raw 503 sent to a connection over the limit.
    overloaded: Bytes,
}

impl ConnectionSlots {
    /// Room for `max_connections` connections.
    #[must_use]
    pub fn new(max_connections: usize) -> Arc<Self> {
        let error = ApiError::upstream(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            format!(
                "the gateway is serving its maximum of {max_connections} connections (server.max_connections): retry in a second"
            ),
        );
        let body = error.body().to_string();
        let overloaded = format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        Arc::new(ConnectionSlots {
            served: Counter::new(max_connections),
            refusing: Counter::new(max_connections),
            overloaded: Bytes::from(overloaded),
        })
    }
}

#[derive(Debug)]
struct Counter {
    count: AtomicUsize,
    max: usize,
}

impl Counter {
    fn new(max: usize) -> Arc<Self> {
        Arc::new(Counter {
            count: AtomicUsize::new(0),
            max,
        })
    }
}

/// One place in a [`Counter`], given back on drop.
struct Slot(Arc<Counter>);

impl Slot {
    fn take(counter: &Arc<Counter>) -> Option<Slot> {
        counter
            .count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < counter.max).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(counter.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `app` on `listener` until `stop` turns true (or its sender is gone), then stops
/// accepting, lets each connection finish its request in flight, and returns once every
/// connection is closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    slots: Arc<ConnectionSlots>,
    mut stop: watch::Receiver<bool>,
) {
    let app = TowerToHyperService::new(app);
    // Each connection holds a sender; `recv` answers `None` once they are all dropped.
    let (open, mut all_closed) = mpsc::channel::<()>(1);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop) => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) if is_client_error(&e) => continue,
            Err(_) => {
                tokio::select! {
                    _ = stop.wait_for(|stop| *stop) => break,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                }
            }
        };
        match Slot::take(&slots.served) {
            Some(slot) => {
                let held = (slot, open.clone());
                tokio::spawn(connection(stream, app.clone(), limits, stop.clone(), held));
            }
            None => refuse(stream, &slots),
        }
    }
    drop(open);
    let _ = all_closed.recv().await;
}

/// Errors of one client's connection, not of the listener.
fn is_client_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// Answers a connection over the limit with the raw 503 and closes it, unserved.
fn refuse(stream: TcpStream, slots: &ConnectionSlots) {
    let overloaded = slots.overloaded.clone();
    let Some(slot) = Slot::take(&slots.refusing) else {
        // The 503 fits a fresh socket's send buffer: written without waiting, or not at all.
        let _ = stream.try_write(&overloaded);
        return;
    };
    // Not waited for by the drain: it ends within `REFUSAL_LINGER` whatever the client does.
    tokio::spawn(async move {
        let _slot = slot;
        let mut stream = stream;
        let deliver = async {
            stream.write_all(&overloaded).await?;
            stream.shutdown().await?;
            // Read (and drop) what the client sends until it closes, so that closing does
            // not reset the connection before the client has read the 503.
            let mut sink = [0u8; 1024];
            while stream.read(&mut sink).await? > 0 {}
            std::io::Result::Ok(())
        };
        let _ = tokio::time::timeout(REFUSAL_LINGER, deliver).await;
    });
}

/// Serves one connection until it closes, a limit of `limits` runs out, or `stop` (then the
/// request in flight finishes first).
async fn connection(
    stream: TcpStream,
    app: TowerToHyperService<Router>,
    limits: ConnectionLimits,
    mut stop: watch::Receiver<bool>,
    held: (Slot, mpsc::Sender<()>),
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(WatchedIo {
        io: stream,
        activity: activity.clone(),
        send_timeout: limits.send_timeout,
        stalled: None,
    });
    let handler = Handler {
        app,
        activity: activity.clone(),
        body_read_timeout: limits.body_read_timeout,
    };
    let conn = http1::Builder::new()
        .header_read_timeout(None)
        .serve_connection(io, handler);
    tokio::pin!(conn);
    let mut draining = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            () = activity.expired(&limits) => {
                // The slot first, so that a client that sees the close can connect again;
                // returning drops the connection, which closes the socket.
                drop(held);
                return;
            }
            _ = stop.wait_for(|stop| *stop), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Where a connection is in its life, for its timeouts.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Waiting for a request's headers since then: the header timeout runs.
    Head(Instant),
    /// This many requests in flight (read, handled, or their response being written).
    Busy(usize),
    /// Nothing in flight since then: the idle timeout runs.
    Idle(Instant),
}

/// A connection's phase, shared by its IO (bytes read), its requests (started, answered) and
/// its watchdog ([`Activity::expired`]). The lock is the connection's own and never held
/// across an `.await`.
struct Activity {
    phase: Mutex<Phase>,
    /// Told when a deadline appears or moves earlier.
    changed: Notify,
}

impl Activity {
    fn new() -> Self {
        Activity {
            phase: Mutex::new(Phase::Head(Instant::now())),
            changed: Notify::new(),
        }
    }

    fn update<R>(&self, f: impl FnOnce(&mut Phase) -> R) -> R {
        f(&mut self.phase.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Bytes arrived: after an idle spell, they start a request, whose headers are now due.
    fn bytes_read(&self) {
        let head = self.update(|phase| match phase {
            Phase::Idle(_) => {
                *phase = Phase::Head(Instant::now());
                true
            }
            Phase::Head(_) | Phase::Busy(_) => false,
        });
        if head {
            self.changed.notify_one();
        }
    }

    fn request_started(&self) {
        self.update(|phase| {
            *phase = Phase::Busy(match *phase {
                Phase::Busy(n) => n + 1,
                Phase::Head(_) | Phase::Idle(_) => 1,
            });
        });
    }

    fn request_finished(&self) {
        let idle = self.update(|phase| match phase {
            Phase::Busy(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                *phase = Phase::Idle(Instant::now());
                true
            }
        });
        if idle {
            self.changed.notify_one();
        }
    }

    /// Resolves when the current phase has outlived its limit: headers not complete within
    /// the header timeout, or idle for the idle timeout. Never while a request is in flight.
    async fn expired(&self, limits: &ConnectionLimits) {
        loop {
            // A notification sent after the phase is read is kept (`notify_one` stores a
            // permit), so none is missed.
            let changed = self.changed.notified();
            let deadline = match self.update(|phase| *phase) {
                Phase::Head(since) => Some(since + limits.header_read_timeout),
                Phase::Idle(since) => Some(since + limits.idle_timeout),
                Phase::Busy(_) => None,
            };
            match deadline {
                Some(deadline) if deadline <= Instant::now() => return,
                Some(deadline) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline) => {}
                        () = changed => {}
                    }
                }
                None => changed.await,
            }
        }
    }
}

/// The socket, telling its connection's [`Activity`] when bytes arrive, and failing a write
/// that has waited `send_timeout` for a client that does not read.
struct WatchedIo {
    io: TcpStream,
    activity: Arc<Activity>,
    send_timeout: Duration,
    /// Runs while writes wait (the socket is full); reset by any progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WatchedIo {
    /// Tracks a write's result: progress resets the send timer; a wait starts it (the timer
    /// wakes the connection when it runs out, so the next poll fails the write).
    fn watch_write<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.send_timeout;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client did not read the response in time",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WatchedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.bytes_read();
        }
        polled
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.watch_write(cx, polled)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.watch_write(cx, polled)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The router as a hyper service: each request's body gets its deadline, and the request
/// stays in flight until its response has been written.
#[derive(Clone)]
struct Handler {
    app: TowerToHyperService<Router>,
    activity: Arc<Activity>,
    body_read_timeout: Duration,
}

impl hyper::service::Service<Request<Incoming>> for Handler {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let in_flight = InFlight::start(self.activity.clone());
        let timed_out = Arc::new(AtomicBool::new(false));
        let deadline = Instant::now() + self.body_read_timeout;
        let req = req.map(|body| {
            Body::new(TimedBody {
                body,
                deadline,
                timer: None,
                timed_out: timed_out.clone(),
            })
        });
        let answer = hyper::service::Service::call(&self.app, req);
        let body_read_timeout = self.body_read_timeout;
        Box::pin(async move {
            let response = match answer.await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            // However the handler reported the unreadable body, the client is told why.
            let response = if timed_out.load(Ordering::Acquire) {
                body_timeout_response(body_read_timeout)
            } else {
                response
            };
            Ok(response.map(|body| {
                Body::new(InFlightBody {
                    body,
                    _in_flight: in_flight,
                })
            }))
        })
    }
}

/// The 408 for a body that did not arrive in time; the connection closes after it.
fn body_timeout_response(limit: Duration) -> Response {
    let mut response = ApiError::invalid(
        StatusCode::REQUEST_TIMEOUT,
        "request_timeout",
        format!(
            "the request body did not arrive within {} ms (server.body_read_timeout_ms): send the whole body at once",
            limit.as_millis()
        ),
    )
    .into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// A request in flight on its connection, from its headers until its response is written
/// (or abandoned).
struct InFlight(Arc<Activity>);

impl InFlight {
    fn start(activity: Arc<Activity>) -> Self {
        activity.request_started();
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A response body that keeps its request in flight until hyper drops it (written or
/// abandoned).
struct InFlightBody {
    body: Body,
    _in_flight: InFlight,
}

impl HttpBody for InFlightBody {
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

/// The body did not arrive within `server.body_read_timeout_ms`.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within server.body_read_timeout_ms")]
struct BodyTimedOut;

/// A request body that fails once its deadline has passed, and says so in `timed_out`.
struct TimedBody {
    body: Incoming,
    deadline: Instant,
    /// Armed on the first wait, so that a body already received costs no timer.
    timer: Option<Pin<Box<Sleep>>>,
    timed_out: Arc<AtomicBool>,
}

impl HttpBody for TimedBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        ready!(timer.as_mut().poll(cx));
        this.timed_out.store(true, Ordering::Release);
        Poll::Ready(Some(Err(BodyTimedOut.into())))
    }
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }
    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
