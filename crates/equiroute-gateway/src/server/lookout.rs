//! Futures polled only when they woke the task.
//!
//! A request's or a connection's task is woken several times a request (bytes arrive, an
//! answer is ready, a write can go on). What watches it (a timeout's timer, a shed's or a
//! stop's notification, the shutdown's cutoff) rarely has anything to say; polled on each
//! of those wake-ups it costs a lock, a clock read or a timer look each time. A [`Lookout`]
//! gives the watchers their own waker, which marks that one of them woke the task: they are
//! polled after such a wake-up (and once at first, to register), not after the others.

use futures_util::task::AtomicWaker;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Wake, Waker};

/// The watchers' waker, and whether it woke the task since the last look.
pub(super) struct Lookout {
    mark: Arc<Mark>,
    waker: Waker,
}

struct Mark {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Mark {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl Lookout {
    /// A lookout whose watchers have not been polled yet (its first look is due).
    pub(super) fn new() -> Self {
        let mark = Arc::new(Mark {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        let waker = Waker::from(mark.clone());
        Lookout { mark, waker }
    }

    /// Whether the watchers are due a poll: one of them woke the task since the last look
    /// (or there was none). Takes the task's waker from `cx` first, so that a watcher that
    /// wakes after this look wakes the task again.
    pub(super) fn due(&self, cx: &Context<'_>) -> bool {
        self.mark.task.register(cx.waker());
        self.mark.woken.swap(false, Ordering::AcqRel)
    }

    /// Polls a watcher with the lookout's waker: true when it is ready.
    pub(super) fn ready<F: Future>(&self, watcher: Pin<&mut F>) -> bool {
        watcher
            .poll(&mut Context::from_waker(&self.waker))
            .is_ready()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::pin;
    use std::sync::atomic::AtomicUsize;
    use tokio::sync::Notify;

    /// Counts the wake-ups of "the task".
    struct Task(AtomicUsize);
    impl Wake for Task {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_watcher_is_due_after_it_woke_the_task_and_only_then() {
        let task = Arc::new(Task(AtomicUsize::new(0)));
        let waker = Waker::from(task.clone());
        let cx = Context::from_waker(&waker);
        let notify = Notify::new();
        let mut watcher = pin!(notify.notified());
        let lookout = Lookout::new();
        // The first look is due: the watcher registers the lookout's waker.
        assert!(lookout.due(&cx));
        assert!(!lookout.ready(watcher.as_mut()));
        // The task woken by something else: the watcher is not due.
        assert!(!lookout.due(&cx));
        assert_eq!(task.0.load(Ordering::SeqCst), 0);
        // The watcher's wake-up reaches the task and makes it due, once.
        notify.notify_waiters();
        assert_eq!(task.0.load(Ordering::SeqCst), 1);
        assert!(lookout.due(&cx));
        assert!(lookout.ready(watcher.as_mut()));
        assert!(!lookout.due(&cx));
    }
}
