//! The accept loop and the life of each connection; every event loop serves its listening
//! socket with [`serve`], so the limits below hold alike on all of them.
//!
//! A client cannot hold a connection for ever: a request's headers must arrive within
//! `header_read_timeout` (counted from the accept, or from the first byte after an idle
//! spell), its body within `body_read_timeout` (else a 408 and the connection is closed), and
//! a keep-alive connection with no request in flight is closed after `idle_timeout`. A
//! response still being written (a streamed answer included) is in flight, so the idle
//! timeout never cuts it.
//!
//! Nor more than its share ([`ConnectionSlots`]), counted per client address (an IPv4
//! address, an IPv6 /64) over every event loop:
//! - connections: an address holds at most `max_connections_per_address` (further ones get a
//!   raw 429); when all `max_connections` are taken, a newcomer takes the oldest connection
//!   of the address holding the most, if that address holds more than the newcomer's would
//!   (the shed connection is closed at once), else it gets a raw 503. Refusals carry
//!   `Retry-After: 1` and are closed without being served. One request at a time per
//!   HTTP/1.1 connection: the share of connections is the share of requests in flight.
//! - memory: a request head over `max_header_bytes` gets a 431 (it also bounds each
//!   connection's read buffer); the bytes of request bodies still arriving are counted
//!   against `max_buffered_bytes_per_address` (a 429 beyond) and `max_buffered_bytes` (a 503
//!   beyond), and the connection is closed after the answer. A body's bytes count until it
//!   has all arrived: a slow client's are the ones held.
//!
//! A connection ends with a linger: its write side closed first, then what the client still
//! sends read and dropped until it closes (at most a second, for at most `max_connections`
//! connections at once), so that an answer after which the connection closes (a 413 for a
//! body left unread, a 431, a refusal) is not erased by the reset that closing a socket with
//! unread bytes sends (at most 64 KiB are read so: a client still sending more is not reading
//! the answer). Connections cut by a timeout or shed are closed at once.
//!
//! A write to a client that does not read (its socket stays full) fails after `send_timeout`
//! without progress: the connection closes, and with it the response (a relayed stream
//! ends, which cancels its upstream call).
//!
//! Hyper's own `header_read_timeout` is not used: it also runs while a keep-alive connection
//! waits for its next request, so it would close idle connections at the header timeout
//! instead of the idle one.

use super::error::ApiError;
use super::metrics::Metrics;
use crate::config::{ConnectionLimits, MIN_MAX_HEADER_BYTES};
use axum::body::{Body, Bytes, HttpBody};
use axum::http::{header, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::counter::Counter as Tally;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::{Instant, Sleep};

/// How long a refused connection is kept to deliver its refusal and read what the client sent
/// meanwhile (closing with unread bytes would reset the connection and lose the answer).
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

/// The most a closing connection reads and drops of what its client still sends.
const LINGER_MAX_BYTES: usize = 64 << 10;

/// The pause after an accept error other than a client's (most likely out of file
/// descriptors): open connections get a moment to close.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// A client address as the fair shares count it: an IPv4 address, or the /64 prefix of an
/// IPv6 address (one host usually holds a whole /64; counted apart, its addresses would take
/// as many shares as it likes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientAddress(IpAddr);

impl ClientAddress {
    /// The address that `ip` counts as (an IPv4-mapped IPv6 address as its IPv4 address).
    #[must_use]
    pub fn of(ip: IpAddr) -> Self {
        ClientAddress(match ip.to_canonical() {
            IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !u128::from(u64::MAX))),
            v4 @ IpAddr::V4(_) => v4,
        })
    }
}

/// What the connections of a gateway hold, over every event loop: the connections of each
/// client address, against `max_connections` and `max_connections_per_address`, and the
/// bytes of request bodies still arriving, against `max_buffered_bytes` and
/// `max_buffered_bytes_per_address`.
#[derive(Debug)]
pub struct ConnectionSlots {
    limits: ConnectionLimits,
    /// Taken when a connection opens or closes, never per request or per read.
    holders: Mutex<Holders>,
    /// Bytes of request bodies still arriving, over every connection.
    buffered: AtomicUsize,
    /// Connections lingering to deliver their last answer (a refusal, or an answer after
    /// which the connection closes), bounded by `max_connections` too; past that a refusal is
    /// written without waiting and the socket closed at once.
    closing: Counter,
    /// The raw 503 sent to a connection when every one is taken by addresses holding no more
    /// than its own.
    full: Bytes,
    /// The raw 429 sent to a connection of an address that holds its share.
    address_full: Bytes,
    /// What was turned away, for `/metrics`.
    refused: Refused,
}

/// The counters of refusals by reason (`equiroute_refusals_total{reason}`); unregistered
/// ones (a gateway without metrics, the tests) count into nothing anyone reads.
#[derive(Debug, Default)]
struct Refused {
    /// Raw 429s: the address held its connections' share.
    too_many_connections: Tally,
    /// Raw 503s: every connection was taken.
    overloaded: Tally,
    /// Connections of the address holding the most, closed for a newcomer.
    shed: Tally,
    /// 429s: the address held its share of bytes of bodies still arriving.
    too_many_buffered_bytes: Tally,
    /// 503s: the gateway held all its bytes of bodies still arriving.
    buffered_bytes_full: Tally,
}

impl Refused {
    fn registered(metrics: &Metrics) -> Self {
        Refused {
            too_many_connections: metrics.refusals("too_many_connections"),
            overloaded: metrics.refusals("overloaded"),
            shed: metrics.refusals("shed"),
            too_many_buffered_bytes: metrics.refusals("too_many_buffered_bytes"),
            buffered_bytes_full: metrics.refusals("buffered_bytes_full"),
        }
    }
}

/// The open connections, by client address. An address is in the table only while it holds
/// a connection, so the table has at most `max_connections` entries whatever the clients do.
#[derive(Debug, Default)]
struct Holders {
    open: usize,
    next_id: u64,
    by_address: HashMap<ClientAddress, Holder>,
}

#[derive(Debug)]
struct Holder {
    share: Arc<AddressShare>,
    /// Its connections, oldest first (ids grow), each with the signal that sheds it.
    connections: BTreeMap<u64, Arc<Notify>>,
}

/// What one client address holds that its connections count without the table's lock.
#[derive(Debug, Default)]
struct AddressShare {
    /// Bytes of its request bodies still arriving.
    buffered: AtomicUsize,
}

/// Why a new connection is not served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// Its address holds `max_connections_per_address`: a 429.
    AddressFull,
    /// All `max_connections` are taken, none by an address holding more than this one: a 503.
    Full,
}

impl ConnectionSlots {
    /// Room for what `limits` allow, its refusals counted in `metrics`.
    #[must_use]
    pub fn counted(limits: &ConnectionLimits, metrics: &Metrics) -> Arc<Self> {
        Self::with(limits, Refused::registered(metrics))
    }

    /// Room for what `limits` allow.
    #[must_use]
    pub fn new(limits: &ConnectionLimits) -> Arc<Self> {
        Self::with(limits, Refused::default())
    }

    fn with(limits: &ConnectionLimits, refused: Refused) -> Arc<Self> {
        let full = ApiError::upstream(
            StatusCode::SERVICE_UNAVAILABLE,
            "overloaded",
            format!(
                "the gateway is serving its maximum of {} connections (server.max_connections): retry in a second",
                limits.max_connections
            ),
        );
        let address_full = ApiError::busy(
            "too_many_connections",
            format!(
                "this client address holds its maximum of {} connections (server.max_connections_per_address): reuse a keep-alive connection, or retry in a second",
                limits.max_connections_per_address
            ),
        );
        Arc::new(ConnectionSlots {
            limits: *limits,
            holders: Mutex::new(Holders::default()),
            buffered: AtomicUsize::new(0),
            closing: Counter::new(limits.max_connections),
            full: raw_refusal(&full),
            address_full: raw_refusal(&address_full),
            refused,
        })
    }

    fn holders(&self) -> std::sync::MutexGuard<'_, Holders> {
        self.holders.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A seat for a new connection from `address`, or why it gets none. When every
    /// connection is taken, the oldest connection of the address holding the most is shed
    /// for it, if that address holds more than this one would.
    fn admit(self: &Arc<Self>, address: ClientAddress) -> Result<Seat, Refusal> {
        let mut holders = self.holders();
        let held = holders
            .by_address
            .get(&address)
            .map_or(0, |h| h.connections.len());
        let at_share = held >= self.limits.max_connections_per_address;
        if holders.open >= self.limits.max_connections {
            // Full: the 503 says so, even to an address that also holds its share.
            if at_share {
                return Err(Refusal::Full);
            }
            let hog = holders
                .by_address
                .values_mut()
                .max_by_key(|h| h.connections.len())
                .filter(|h| h.connections.len() > held + 1)
                .ok_or(Refusal::Full)?;
            // At least two connections: the hog stays in the table.
            if let Some((_, shed)) = hog.connections.pop_first() {
                shed.notify_one();
                holders.open -= 1;
                self.refused.shed.inc();
            }
        } else if at_share {
            return Err(Refusal::AddressFull);
        }
        holders.open += 1;
        let id = holders.next_id;
        holders.next_id += 1;
        let shed = Arc::new(Notify::new());
        let holder = holders.by_address.entry(address).or_insert_with(|| Holder {
            share: Arc::default(),
            connections: BTreeMap::new(),
        });
        holder.connections.insert(id, shed.clone());
        Ok(Seat {
            slots: self.clone(),
            address,
            id,
            shed,
            share: holder.share.clone(),
        })
    }

    /// The connections open now, and the bytes of request bodies still arriving.
    #[must_use]
    pub fn held(&self) -> (usize, usize) {
        (self.holders().open, self.buffered.load(Ordering::Acquire))
    }
}

/// The raw response of a refused connection: `error` as its OpenAI body, with
/// `Retry-After: 1` and `Connection: close`.
fn raw_refusal(error: &ApiError) -> Bytes {
    raw_answer(error, "retry-after: 1\r\n")
}

/// `error` as a whole HTTP/1.1 response with `Connection: close`, for the answers written
/// below hyper; `extra` is more header lines, each ending in CRLF.
fn raw_answer(error: &ApiError, extra: &str) -> Bytes {
    let body = error.body().to_string();
    Bytes::from(format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\n{extra}connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        error.status.as_u16(),
        error.status.canonical_reason().unwrap_or(""),
        body.len()
    ))
}

/// The answer in place of hyper's own, empty one to a request it could not parse (`head`,
/// as hyper wrote it, starts with its status line): a 431 for a head over
/// `max_header_bytes`, a 414 for a request target over 65,534 bytes, a 400 for anything
/// else that is not HTTP/1.1 (a `Content-Length` that is not a number, or two that differ).
/// `None` for any other write.
fn protocol_error(head: &[u8], max_header_bytes: usize) -> Option<ApiError> {
    // Hyper's answer is a head alone, with `content-length: 0`; every answer of the
    // gateway's own to these statuses has a body.
    let empty = head.ends_with(b"\r\n\r\n")
        && head
            .windows(b"\r\ncontent-length: 0\r\n".len())
            .any(|w| w.eq_ignore_ascii_case(b"\r\ncontent-length: 0\r\n"));
    if !empty {
        return None;
    }
    let status = head.strip_prefix(b"HTTP/1.")?.get(2..5)?;
    let (status, code, message) = match status {
        b"431" => (
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "request_header_fields_too_large",
            format!("the request line and headers exceed {max_header_bytes} bytes (server.max_header_bytes): send smaller headers"),
        ),
        b"414" => (
            StatusCode::URI_TOO_LONG,
            "uri_too_long",
            "the request target exceeds 65534 bytes: send the data in the body".to_owned(),
        ),
        b"400" => (
            StatusCode::BAD_REQUEST,
            "malformed_http_request",
            "the request is not valid HTTP/1.1 (a malformed request line or header, e.g. a Content-Length that is not a number or two that differ): fix the client".to_owned(),
        ),
        _ => return None,
    };
    Some(ApiError::invalid(status, code, message))
}

/// A connection's place among the open ones, given back on drop (unless it was shed, which
/// handed its place to a newcomer).
struct Seat {
    slots: Arc<ConnectionSlots>,
    address: ClientAddress,
    id: u64,
    /// Told when the connection is shed for a newcomer.
    shed: Arc<Notify>,
    share: Arc<AddressShare>,
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut holders = self.slots.holders();
        let Some(holder) = holders.by_address.get_mut(&self.address) else {
            return;
        };
        if holder.connections.remove(&self.id).is_none() {
            return;
        }
        if holder.connections.is_empty() {
            holders.by_address.remove(&self.address);
        }
        holders.open -= 1;
    }
}

/// Adds `n` to `count` if the sum stays within `max`; whether it did.
fn take(count: &AtomicUsize, n: usize, max: usize) -> bool {
    count
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
            c.checked_add(n).filter(|sum| *sum <= max)
        })
        .is_ok()
}

#[derive(Debug)]
struct Counter {
    count: AtomicUsize,
    max: usize,
}

impl Counter {
    fn new(max: usize) -> Self {
        Counter {
            count: AtomicUsize::new(0),
            max,
        }
    }
}

/// One place in the closing [`Counter`] of a [`ConnectionSlots`], given back on drop.
struct Slot(Arc<ConnectionSlots>);

impl Slot {
    fn take(slots: &Arc<ConnectionSlots>) -> Option<Slot> {
        take(&slots.closing.count, 1, slots.closing.max).then(|| Slot(slots.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.closing.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serves `app` on `listener` until `stop` turns true (or its sender is gone), then stops
/// accepting, lets each connection finish its request in flight, and returns once every
/// connection is closed. `slots` holds the limits, shared with the other event loops.
pub async fn serve(
    listener: TcpListener,
    app: Router,
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
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) if is_client_error(&e) => continue,
            Err(_) => {
                tokio::select! {
                    _ = stop.wait_for(|stop| *stop) => break,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                }
            }
        };
        match slots.admit(ClientAddress::of(peer.ip())) {
            Ok(seat) => {
                let held = (seat, open.clone());
                tokio::spawn(connection(stream, app.clone(), stop.clone(), held));
            }
            Err(refusal) => refuse(stream, &slots, refusal),
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

/// Answers a connection over a limit with its raw refusal and closes it, unserved.
fn refuse(stream: TcpStream, slots: &Arc<ConnectionSlots>, refusal: Refusal) {
    let answer = match refusal {
        Refusal::AddressFull => {
            slots.refused.too_many_connections.inc();
            slots.address_full.clone()
        }
        Refusal::Full => {
            slots.refused.overloaded.inc();
            slots.full.clone()
        }
    };
    let Some(slot) = Slot::take(slots) else {
        // The answer fits a fresh socket's send buffer: written without waiting, or not at all.
        let _ = stream.try_write(&answer);
        return;
    };
    // Not waited for by the drain: it ends within `REFUSAL_LINGER` whatever the client does.
    tokio::spawn(async move {
        let mut stream = stream;
        if let Ok(Ok(())) = tokio::time::timeout(REFUSAL_LINGER, stream.write_all(&answer)).await {
            linger(stream, slot).await;
        }
    });
}

/// Closes `stream` after its last answer without losing it: the write side first, then what
/// the client still sends is read and dropped until it closes, at most `REFUSAL_LINGER` and
/// `LINGER_MAX_BYTES`. Closed with unread bytes (a body refused unread, a head over the
/// limit), the socket would be reset, and a reset can erase the answer before the client has
/// read it.
async fn linger(mut stream: TcpStream, _slot: Slot) {
    let drain = async {
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut dropped = 0;
        // A client still sending that much is not reading the answer: not worth the work.
        while dropped < LINGER_MAX_BYTES {
            match stream.read(&mut sink).await? {
                0 => break,
                n => dropped += n,
            }
        }
        std::io::Result::Ok(())
    };
    let _ = tokio::time::timeout(REFUSAL_LINGER, drain).await;
}

/// How a served connection ended.
enum Ended {
    /// Hyper is done with it (closed by either side, or after an answer that closes it):
    /// closed with [`linger`].
    Served,
    /// Cut by a timeout, or shed for a newcomer: closed at once.
    Cut,
}

/// Serves one connection until it closes, a limit runs out, it is shed for a newcomer, or
/// `stop` (then the request in flight finishes first).
async fn connection(
    mut stream: TcpStream,
    app: TowerToHyperService<Router>,
    mut stop: watch::Receiver<bool>,
    held: (Seat, mpsc::Sender<()>),
) {
    let slots = held.0.slots.clone();
    let limits = slots.limits;
    let shed = held.0.shed.clone();
    let ended = {
        let activity = Arc::new(Activity::new());
        let io = TokioIo::new(WatchedIo {
            io: &mut stream,
            activity: activity.clone(),
            send_timeout: limits.send_timeout,
            stalled: None,
            max_header_bytes: limits.max_header_bytes,
            replacing: None,
        });
        let handler = Handler {
            app,
            activity: activity.clone(),
            slots: slots.clone(),
            share: held.0.share.clone(),
        };
        let conn = http1::Builder::new()
            .header_read_timeout(None)
            // The head's limit (a 431 beyond) also bounds the read buffer, whatever the client
            // sends; hyper's own default is ~400 KB per connection.
            .max_header_size(limits.max_header_bytes)
            .max_buf_size(limits.max_header_bytes.max(MIN_MAX_HEADER_BYTES))
            .serve_connection(io, handler);
        tokio::pin!(conn);
        let mut draining = false;
        loop {
            tokio::select! {
                _ = conn.as_mut() => break Ended::Served,
                () = activity.expired(&limits) => break Ended::Cut,
                // Its seat went to a newcomer: closed at once, whatever it was doing.
                () = shed.notified() => break Ended::Cut,
                _ = stop.wait_for(|stop| *stop), if !draining => {
                    draining = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
        // Hyper's connection (its buffers, the request in flight) is dropped here.
    };
    // The seat first, so that a client that sees the close can connect again, and the drain
    // does not wait for a linger.
    drop(held);
    if let (Ended::Served, Some(slot)) = (ended, Slot::take(&slots)) {
        linger(stream, slot).await;
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

    /// Whether a request's head is being read: hyper writes nothing then but its own answer
    /// to a request it could not parse (an answer's last bytes are written once the
    /// connection is idle, before any more bytes arrive).
    fn reading_head(&self) -> bool {
        self.update(|phase| matches!(phase, Phase::Head(_)))
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
struct WatchedIo<'a> {
    io: &'a mut TcpStream,
    activity: Arc<Activity>,
    send_timeout: Duration,
    /// Runs while writes wait (the socket is full); reset by any progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    /// `max_header_bytes`, for the 431's message.
    max_header_bytes: usize,
    /// The answer being written in place of hyper's empty one to a request it could not
    /// parse ([`protocol_error`]), and the length of hyper's, reported written once it is.
    replacing: Option<(Bytes, usize)>,
}

impl WatchedIo<'_> {
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

impl AsyncRead for WatchedIo<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut *this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.bytes_read();
        }
        polled
    }
}

impl WatchedIo<'_> {
    /// Writes `buf`, or, when it is hyper's own empty answer to a request it could not parse
    /// (written with no request in flight), the OpenAI-shaped answer in its place.
    fn write_or_replace(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.replacing.is_none() && self.activity.reading_head() {
            if let Some(error) = protocol_error(buf, self.max_header_bytes) {
                self.replacing = Some((raw_answer(&error, ""), buf.len()));
            }
        }
        loop {
            let Some((answer, stands_for)) = &self.replacing else {
                let polled = Pin::new(&mut *self.io).poll_write(cx, buf);
                return self.watch_write(cx, polled);
            };
            if answer.is_empty() {
                let written = *stands_for;
                self.replacing = None;
                return Poll::Ready(Ok(written));
            }
            let polled = Pin::new(&mut *self.io).poll_write(cx, answer);
            match ready!(self.watch_write(cx, polled)) {
                Ok(0) => return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    if let Some((answer, _)) = &mut self.replacing {
                        *answer = answer.slice(n..);
                    }
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for WatchedIo<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut().write_or_replace(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.activity.reading_head() {
            // Perhaps hyper's own answer: its head is one buffer.
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &**b);
            return this.write_or_replace(cx, first);
        }
        let polled = Pin::new(&mut *this.io).poll_write_vectored(cx, bufs);
        this.watch_write(cx, polled)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().io).poll_shutdown(cx)
    }
}

/// The router as a hyper service: each request's body gets its deadline and its share of
/// the buffered bytes, and the request stays in flight until its response has been written.
#[derive(Clone)]
struct Handler {
    app: TowerToHyperService<Router>,
    activity: Arc<Activity>,
    slots: Arc<ConnectionSlots>,
    share: Arc<AddressShare>,
}

impl hyper::service::Service<Request<Incoming>> for Handler {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let in_flight = InFlight::start(self.activity.clone());
        let fault = Arc::new(OnceLock::new());
        let limits = self.slots.limits;
        let deadline = Instant::now() + limits.body_read_timeout;
        let req = req.map(|body| {
            Body::new(ArrivingBody {
                body,
                deadline,
                timer: None,
                bytes: ArrivingBytes {
                    slots: self.slots.clone(),
                    share: self.share.clone(),
                    held: 0,
                },
                fault: fault.clone(),
            })
        });
        let answer = hyper::service::Service::call(&self.app, req);
        Box::pin(async move {
            let response = match answer.await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            // However the handler reported the unreadable body, the client is told why.
            let response = match fault.get() {
                Some(fault) => fault.response(&limits),
                None => response,
            };
            Ok(HeldBody::hold(response, in_flight))
        })
    }
}

/// Why a request's body could not be read to its end; the connection closes after the
/// answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
enum BodyFault {
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
    fn response(self, limits: &ConnectionLimits) -> Response {
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

/// A response body that holds `G` (a request's seat among those in flight) until hyper
/// drops it (written or abandoned).
pub(super) struct HeldBody<G> {
    body: Body,
    _held: G,
}

impl<G: Send + Unpin + 'static> HeldBody<G> {
    /// `response` with its body holding `held` until it is dropped.
    pub(super) fn hold(response: Response, held: G) -> Response {
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
struct ArrivingBytes {
    slots: Arc<ConnectionSlots>,
    share: Arc<AddressShare>,
    held: usize,
}

impl ArrivingBytes {
    /// Counts `n` more bytes, or says which limit they would pass (counting nothing).
    fn grow(&mut self, n: usize) -> Result<(), BodyFault> {
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

    fn release(&mut self) {
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
struct ArrivingBody {
    body: Incoming,
    deadline: Instant,
    /// Armed on the first wait, so that a body already received costs no timer.
    timer: Option<Pin<Box<Sleep>>>,
    bytes: ArrivingBytes,
    fault: Arc<OnceLock<BodyFault>>,
}

impl ArrivingBody {
    fn fail(&mut self, fault: BodyFault) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn only_hyper_s_empty_answers_to_unparsable_requests_are_replaced() {
        let hyper =
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let e = protocol_error(hyper, 32768).unwrap();
        assert_eq!(
            (e.status, e.code),
            (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "request_header_fields_too_large"
            )
        );
        assert!(e.message.contains("32768 bytes"), "{}", e.message);
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 99\r\n\r\n{\"error\":{}}";
        assert!(protocol_error(ours, 32768).is_none());
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert!(protocol_error(ok, 32768).is_none());
        let raw = raw_answer(&e, "");
        assert!(raw.starts_with(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        assert!(raw.ends_with(e.body().to_string().as_bytes()));
    }

    /// `max` connections, `per_address` per address; 1,000 buffered bytes, 600 per address.
    fn slots(max: usize, per_address: usize) -> Arc<ConnectionSlots> {
        ConnectionSlots::new(&ConnectionLimits {
            max_connections: max,
            max_connections_per_address: per_address,
            max_buffered_bytes: 1000,
            max_buffered_bytes_per_address: 600,
            ..ConnectionLimits::default()
        })
    }

    fn addr(ip: &str) -> ClientAddress {
        ClientAddress::of(ip.parse().unwrap())
    }

    fn nth(i: u32) -> ClientAddress {
        ClientAddress::of(IpAddr::from(i.to_be_bytes()))
    }

    #[test]
    fn ipv6_addresses_count_by_their_64_prefix_and_mapped_ipv4_as_ipv4() {
        assert_eq!(addr("2001:db8:1:2::1"), addr("2001:db8:1:2:ffff::9"));
        assert_ne!(addr("2001:db8:1:2::1"), addr("2001:db8:1:3::1"));
        assert_eq!(addr("::ffff:10.0.0.1"), addr("10.0.0.1"));
        assert_ne!(addr("10.0.0.1"), addr("10.0.0.2"));
    }

    #[test]
    fn the_table_holds_only_addresses_with_open_connections() {
        let slots = slots(4, 4);
        for i in 0..10_000 {
            drop(slots.admit(nth(i)).unwrap());
        }
        assert_eq!(slots.holders().by_address.len(), 0, "none remembered");
        assert_eq!(slots.held().0, 0);
        // Open at once, at most `max_connections` addresses: nobody holds more than a
        // newcomer would, so the fifth is refused.
        let seats: Vec<_> = (0..10).map(|i| slots.admit(nth(i))).collect();
        assert_eq!(seats.iter().filter(|s| s.is_ok()).count(), 4);
        assert_eq!(seats[4].as_ref().err(), Some(&Refusal::Full));
        assert_eq!(slots.holders().by_address.len(), 4);
    }

    #[tokio::test]
    async fn a_full_gateway_sheds_the_biggest_holders_oldest_connection() {
        let slots = slots(4, 3);
        let (hog, other) = (addr("10.0.0.1"), addr("10.0.0.2"));
        let hogs: Vec<Seat> = (0..3).map(|_| slots.admit(hog).unwrap()).collect();
        assert_eq!(slots.admit(hog).err(), Some(Refusal::AddressFull));
        let first = slots.admit(other).unwrap();
        // Full (3 + 1): the hog holds 3, more than the 2 `other` would hold.
        let second = slots.admit(other).unwrap();
        tokio::time::timeout(Duration::from_secs(1), hogs[0].shed.notified())
            .await
            .expect("the hog's oldest is told to close");
        assert_eq!(slots.held().0, 4, "its seat was handed over");
        // 2 + 2: nobody holds more than `other` would after a third.
        assert_eq!(slots.admit(other).err(), Some(Refusal::Full));
        drop(hogs);
        assert_eq!(slots.held().0, 2, "the shed seat is not given back twice");
        drop((first, second));
        assert_eq!(slots.held().0, 0);
        assert!(slots.holders().by_address.is_empty());
    }

    #[test]
    fn arriving_bytes_count_against_the_address_share_then_the_total() {
        let slots = slots(8, 8);
        let (a, b) = (
            slots.admit(addr("10.0.0.1")).unwrap(),
            slots.admit(addr("10.0.0.2")).unwrap(),
        );
        let bytes = |seat: &Seat| ArrivingBytes {
            slots: slots.clone(),
            share: seat.share.clone(),
            held: 0,
        };
        let (mut a1, mut a2, mut b1) = (bytes(&a), bytes(&a), bytes(&b));
        a1.grow(500).unwrap();
        assert_eq!(a2.grow(200), Err(BodyFault::AddressOverShare), "700 > 600");
        a2.grow(100).unwrap();
        b1.grow(300).unwrap();
        assert_eq!(b1.grow(200), Err(BodyFault::Overloaded), "1,100 > 1,000");
        assert_eq!(slots.held().1, 900, "a refused growth counts nothing");
        drop(a1);
        a2.release();
        assert_eq!(slots.held().1, 300);
        assert_eq!(a.share.buffered.load(Ordering::Acquire), 0);
        drop(b1);
        assert_eq!(slots.held().1, 0);
    }
}
