//! The watched socket of one connection: what phase it is in (waiting for a head, reading a
//! body, idle, writing), and the reads and writes that keep its clocks and enforce its
//! timeouts.

use crate::config::ConnectionLimits;
use axum::body::Bytes;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::{protocol_error, raw_answer};

/// Where a connection is in its life, for its timeouts.
#[derive(Clone, Copy, Debug)]
pub(super) enum Phase {
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
pub(super) struct Activity {
    pub(super) phase: Mutex<Phase>,
}

impl Activity {
    pub(super) fn new() -> Self {
        Activity {
            phase: Mutex::new(Phase::Head(Instant::now())),
        }
    }

    pub(super) fn update<R>(&self, f: impl FnOnce(&mut Phase) -> R) -> R {
        f(&mut self.phase.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Bytes arrived: after an idle spell, they start a request, whose headers are now due.
    pub(super) fn bytes_read(&self) {
        self.update(|phase| {
            if let Phase::Idle(_) = phase {
                *phase = Phase::Head(Instant::now());
            }
        });
    }

    pub(super) fn request_started(&self) {
        self.update(|phase| {
            *phase = Phase::Busy(match *phase {
                Phase::Busy(n) => n + 1,
                Phase::Head(_) | Phase::Idle(_) => 1,
            });
        });
    }

    pub(super) fn request_finished(&self) {
        self.update(|phase| match phase {
            Phase::Busy(n) if *n > 1 => *n -= 1,
            _ => *phase = Phase::Idle(Instant::now()),
        });
    }

    /// Whether a request's head is being read: hyper writes nothing then but its own answer
    /// to a request it could not parse (an answer's last bytes are written once the
    /// connection is idle, before any more bytes arrive).
    pub(super) fn reading_head(&self) -> bool {
        self.update(|phase| matches!(phase, Phase::Head(_)))
    }

    /// Resolves when the current phase has outlived its limit: headers not complete within
    /// the header timeout, or idle for the idle timeout. Never while a request is in flight.
    ///
    /// Nothing tells the watchdog that the phase changed (that cost every request a wake-up
    /// and a new timer): it wakes at the current phase's deadline, or sooner, after the
    /// shorter of the two timeouts. A phase that starts later has its deadline at least that
    /// long after its start, so no deadline is ever overslept, and a busy or idle connection
    /// costs one wake-up per that interval rather than one per request.
    pub(super) async fn expired(&self, limits: &ConnectionLimits) {
        let recheck = limits
            .header_read_timeout
            .min(limits.idle_timeout)
            .max(MIN_RECHECK);
        let sleep = tokio::time::sleep(recheck);
        tokio::pin!(sleep);
        loop {
            let now = Instant::now();
            let deadline = match self.update(|phase| *phase) {
                Phase::Head(since) => Some(since + limits.header_read_timeout),
                Phase::Idle(since) => Some(since + limits.idle_timeout),
                Phase::Busy(_) => None,
            };
            if deadline.is_some_and(|deadline| deadline <= now) {
                return;
            }
            let wake = deadline.map_or(now + recheck, |deadline| deadline.min(now + recheck));
            sleep.as_mut().reset(wake);
            sleep.as_mut().await;
        }
    }
}

/// The watchdog's shortest interval between two looks at the phase, whatever the limits.
const MIN_RECHECK: Duration = Duration::from_millis(1);

/// The socket (or the TLS stream over it), telling its connection's [`Activity`] when bytes
/// arrive, and failing a write that has waited `send_timeout` for a client that does not read.
pub(super) struct WatchedIo<'a, S> {
    pub(super) io: &'a mut S,
    pub(super) activity: Arc<Activity>,
    pub(super) send_timeout: Duration,
    /// Runs while writes wait (the socket is full); reset by any progress.
    pub(super) stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    /// `max_header_bytes`, for the 431's message.
    pub(super) max_header_bytes: usize,
    /// The answer being written in place of hyper's empty one to a request it could not
    /// parse ([`protocol_error`]), and the length of hyper's, reported written once it is.
    pub(super) replacing: Option<(Bytes, usize)>,
    /// HTTP/1.1: bytes after an idle spell start a request's head, and hyper's own answers
    /// to unparsable requests are replaced. HTTP/2's frames between requests (window
    /// updates, pings) start nothing: its requests are counted when hyper hands them over.
    pub(super) http1: bool,
}

impl<S> WatchedIo<'_, S> {
    /// Tracks a write's result: progress resets the send timer; a wait starts it (the timer
    /// wakes the connection when it runs out, so the next poll fails the write).
    pub(super) fn watch_write<T>(
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

impl<S: AsyncRead + Unpin> AsyncRead for WatchedIo<'_, S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut *this.io).poll_read(cx, buf);
        if this.http1 && buf.filled().len() > before {
            this.activity.bytes_read();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> WatchedIo<'_, S> {
    /// Writes `buf`, or, when it is hyper's own empty answer to a request it could not parse
    /// (written with no request in flight), the OpenAI-shaped answer in its place.
    pub(super) fn write_or_replace(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.http1 && self.replacing.is_none() && self.activity.reading_head() {
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

impl<S: AsyncWrite + Unpin> AsyncWrite for WatchedIo<'_, S> {
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
        if this.http1 && this.activity.reading_head() {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The watchdog is never told that the phase changed: it must still fire at each phase's
    /// own deadline, the idle one after a request, and a head's that comes before the idle
    /// deadline it was sleeping toward.
    #[tokio::test(start_paused = true)]
    async fn the_watchdog_fires_at_each_phases_deadline_without_being_told() {
        let limits = ConnectionLimits {
            header_read_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(5),
            ..ConnectionLimits::default()
        };
        let activity = Arc::new(Activity::new());
        let start = Instant::now();
        // Busy from 0.5 s (before the head's deadline), idle from 3 s: due at 8 s.
        let a = activity.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            a.request_started();
            tokio::time::sleep(Duration::from_millis(2500)).await;
            a.request_finished();
        });
        activity.expired(&limits).await;
        assert_eq!(Instant::now() - start, Duration::from_secs(8));

        // Idle from 8 s; bytes at 10 s start a head, due at 11 s, before the idle deadline
        // (13 s).
        activity.request_started();
        activity.request_finished();
        let idle_from = Instant::now();
        let a = activity.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            a.bytes_read();
        });
        activity.expired(&limits).await;
        assert_eq!(Instant::now() - idle_from, Duration::from_secs(3));
    }
}
