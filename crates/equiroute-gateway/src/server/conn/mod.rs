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
//! With `[server.tls]` every connection is first a TLS handshake ([`tls`]), within the header
//! timeout; ALPN then picks HTTP/2 or HTTP/1.1. An HTTP/2 connection carries at most
//! [`H2_MAX_STREAMS`] requests at once (each body counted as above, and at most 64 KiB of
//! bodies unread, its flow-control window), and its idle timeout runs
//! whenever no request is in flight (its frames between requests do not start a head's
//! timer). A refused connection of an HTTPS listener is closed without an answer: writing a
//! refusal would take the handshake the refusal is there to save.
//!
//! Before routing, a request whose `Content-Length` is over `max_body_bytes` gets a 413 at
//! once, instead of after waiting (up to the body timeout) for a body that would be refused;
//! the connection closes after it, its body unread. At the drain's cutoff ([`super::drain`])
//! what is still in flight is ended.
//!
//! Hyper's own `header_read_timeout` is not used: it also runs while a keep-alive connection
//! waits for its next request, so it would close idle connections at the header timeout
//! instead of the idle one.

use super::drain::{self, Cutoff};
use super::error::ApiError;
use super::metrics::Metrics;
use crate::config::{ConnectionLimits, MIN_MAX_HEADER_BYTES};
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::counter::Counter as Tally;
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};
use tokio::time::Instant;

mod body;
mod io;
pub mod tls;
mod watchers;

pub(super) use body::HeldBody;
use body::{ArrivingBody, ArrivingBytes, InFlight};
use io::{Activity, WatchedIo};
use tls::Tls;
use watchers::Watch;

/// Most requests in flight at once on one HTTP/2 connection (its concurrent streams).
pub const H2_MAX_STREAMS: u32 = 16;

/// Most bytes of a response an HTTP/2 stream buffers for a client that reads slowly
/// (hyper's default is ~400 KB per stream): 256 KiB over a connection's 16 streams.
const H2_SEND_BUFFER_BYTES: usize = 16 << 10;

/// HTTP/2's flow-control windows, of the connection and of each stream: the most bytes of
/// request bodies a client may send before the gateway reads them (hyper's default is 1 MiB
/// per stream; these are the protocol's own defaults), so a connection holds at most this
/// much unread, like an HTTP/1.1 connection's read buffer.
const H2_WINDOW_BYTES: u32 = 65_535;

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

/// What each connection serves: the router, behind the check of a declared body size and
/// the drain's cutoff (see the module's documentation).
#[derive(Clone)]
pub struct App {
    router: TowerToHyperService<Router>,
    max_body_bytes: usize,
    cutoff: watch::Receiver<bool>,
}

impl App {
    /// `router`, refusing bodies declared over `max_body_bytes`, its requests ended at
    /// `cutoff`.
    #[must_use]
    pub fn new(router: Router, max_body_bytes: usize, cutoff: &Cutoff) -> App {
        App {
            router: TowerToHyperService::new(router),
            max_body_bytes,
            cutoff: cutoff.receiver(),
        }
    }

    /// Whether `req` declares a body over the limit.
    fn declares_oversize<B>(&self, req: &Request<B>) -> bool {
        req.headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > self.max_body_bytes as u64)
    }
}

/// The 413 of a body declared too large; the connection closes after it, the body unread.
fn oversize() -> Response {
    let mut response = ApiError::body_too_large().into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Serves `app` on `listener` until `stop` turns true (or its sender is gone), then stops
/// accepting, lets each connection finish its request in flight, and returns once every
/// connection is closed. `slots` holds the limits, shared with the other event loops.
pub async fn serve(
    listener: TcpListener,
    app: App,
    slots: Arc<ConnectionSlots>,
    mut stop: watch::Receiver<bool>,
    tls: Option<Arc<Tls>>,
) {
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
                let (app, stop) = (app.clone(), stop.clone());
                match &tls {
                    None => tokio::spawn(connection(stream, app, stop, held, Protocol::Http1)),
                    Some(tls) => {
                        tokio::spawn(secured(stream, peer.ip(), tls.clone(), app, stop, held))
                    }
                };
            }
            // Closed unanswered: the answer would need the handshake the refusal saves.
            Err(refusal) if tls.is_some() => drop(count_refusal(&slots, refusal)),
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

/// Counts a refusal; its raw answer.
fn count_refusal(slots: &ConnectionSlots, refusal: Refusal) -> Bytes {
    match refusal {
        Refusal::AddressFull => {
            slots.refused.too_many_connections.inc();
            slots.address_full.clone()
        }
        Refusal::Full => {
            slots.refused.overloaded.inc();
            slots.full.clone()
        }
    }
}

/// Answers a connection over a limit with its raw refusal and closes it, unserved.
fn refuse(stream: TcpStream, slots: &Arc<ConnectionSlots>, refusal: Refusal) {
    let answer = count_refusal(slots, refusal);
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
async fn linger<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, _slot: Slot) {
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

/// The protocol a connection speaks: HTTP/1.1, or HTTP/2 when a TLS client chose it (ALPN).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// Serves one connection of an HTTPS listener: its handshake (within the header timeout,
/// cut short by a shed or a stop), then [`connection`] in the protocol the client chose.
async fn secured(
    stream: TcpStream,
    peer: IpAddr,
    tls: Arc<Tls>,
    app: App,
    mut stop: watch::Receiver<bool>,
    held: (Seat, mpsc::Sender<()>),
) {
    let limit = held.0.slots.limits.header_read_timeout;
    let shed = held.0.shed.clone();
    let stream = tokio::select! {
        stream = tls.handshake(stream, peer, limit) => stream,
        () = shed.notified() => None,
        _ = stop.wait_for(|stop| *stop) => None,
    };
    // A failed handshake gives its seat back here.
    let Some(stream) = stream else { return };
    let protocol = if stream.get_ref().1.alpn_protocol() == Some(&b"h2"[..]) {
        Protocol::Http2
    } else {
        Protocol::Http1
    };
    connection(stream, app, stop, held, protocol).await;
}

/// Serves one connection until it closes, a limit runs out, it is shed for a newcomer, or
/// `stop` (then the requests in flight finish first).
async fn connection<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    app: App,
    mut stop: watch::Receiver<bool>,
    held: (Seat, mpsc::Sender<()>),
    protocol: Protocol,
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
            http1: protocol == Protocol::Http1,
        });
        let handler = Handler {
            app,
            activity: activity.clone(),
            slots: slots.clone(),
            share: held.0.share.clone(),
        };
        let watch = Watch {
            activity: &activity,
            limits: &limits,
            shed: &shed,
        };
        match protocol {
            Protocol::Http1 => {
                let conn = http1::Builder::new()
                    .header_read_timeout(None)
                    // The head's limit (a 431 beyond) also bounds the read buffer, whatever the
                    // client sends; hyper's own default is ~400 KB per connection.
                    .max_header_size(limits.max_header_bytes)
                    .max_buf_size(limits.max_header_bytes.max(MIN_MAX_HEADER_BYTES))
                    .serve_connection(io, handler);
                tokio::pin!(conn);
                watch
                    .drive(conn, http1::Connection::graceful_shutdown, &mut stop)
                    .await
            }
            Protocol::Http2 => {
                let conn = http2::Builder::new(TokioExecutor::new())
                    .max_header_list_size(
                        u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX),
                    )
                    .max_concurrent_streams(H2_MAX_STREAMS)
                    .max_send_buf_size(H2_SEND_BUFFER_BYTES)
                    .initial_connection_window_size(H2_WINDOW_BYTES)
                    .initial_stream_window_size(H2_WINDOW_BYTES)
                    .serve_connection(io, handler);
                tokio::pin!(conn);
                watch
                    .drive(conn, http2::Connection::graceful_shutdown, &mut stop)
                    .await
            }
        }
        // Hyper's connection (its buffers, the requests in flight) is dropped here.
    };
    // The seat first, so that a client that sees the close can connect again, and the drain
    // does not wait for a linger.
    drop(held);
    if let (Ended::Served, Some(slot)) = (ended, Slot::take(&slots)) {
        linger(stream, slot).await;
    }
}

/// The router as a hyper service: each request's body gets its deadline and its share of
/// the buffered bytes, and the request stays in flight until its response has been written.
#[derive(Clone)]
struct Handler {
    app: App,
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
        if self.app.declares_oversize(&req) {
            return Box::pin(std::future::ready(Ok(HeldBody::hold(
                oversize(),
                in_flight,
            ))));
        }
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
        let answer = hyper::service::Service::call(&self.app.router, req);
        let cutoff = self.app.cutoff.clone();
        Box::pin(async move {
            let answer = async {
                match answer.await {
                    Ok(response) => response,
                    Err(never) => match never {},
                }
            };
            let response = drain::until_cut(cutoff, answer).await;
            // However the handler reported the unreadable body, the client is told why.
            let response = match fault.get() {
                Some(fault) => fault.response(&limits),
                None => response,
            };
            Ok(HeldBody::hold(response, in_flight))
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::body::BodyFault;
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
