//! What ends a served connection besides itself: its timeouts, a shed, the gateway's stop.
//! They are polled only after one of them woke the connection's task ([`Lookout`]), not on
//! each of the task's several wake-ups a request.

use super::io::Activity;
use super::Ended;
use crate::config::ConnectionLimits;
use crate::server::lookout::Lookout;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::task::Poll;
use tokio::sync::{watch, Notify};

pub(super) struct Watch<'a> {
    pub(super) activity: &'a Activity,
    pub(super) limits: &'a ConnectionLimits,
    pub(super) shed: &'a Notify,
}

impl Watch<'_> {
    /// Runs hyper's connection `conn` until it ends or is cut; on `stop`, `graceful` asks it
    /// to finish its requests in flight and close.
    pub(super) async fn drive<C: Future>(
        &self,
        mut conn: Pin<&mut C>,
        graceful: impl Fn(Pin<&mut C>),
        stop: &mut watch::Receiver<bool>,
    ) -> Ended {
        let lookout = Lookout::new();
        let mut expired = pin!(self.activity.expired(self.limits));
        // Its seat went to a newcomer: closed at once, whatever it was doing.
        let mut shed = pin!(self.shed.notified());
        let mut stopped = pin!(stop.wait_for(|stop| *stop));
        let mut draining = false;
        poll_fn(|cx| {
            if conn.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ended::Served);
            }
            if !lookout.due(cx) {
                return Poll::Pending;
            }
            if lookout.ready(expired.as_mut()) || lookout.ready(shed.as_mut()) {
                return Poll::Ready(Ended::Cut);
            }
            // A stop (or its sender gone) asks once for a graceful close; then hyper's
            // connection ends by itself, or a watcher cuts it.
            if !draining && lookout.ready(stopped.as_mut()) {
                draining = true;
                graceful(conn.as_mut());
                // What the graceful close changed is seen on the connection's next poll.
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        })
        .await
    }
}
