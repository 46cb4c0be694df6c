//! The request path's claims of a request's feedback in Redis ([`Claims`]), so that a score
//! posted to several instances is applied once.

use equiroute_core::Millis;
use redis::aio::MultiplexedConnection;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// What became of a claim of a request's feedback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This instance holds the claim: it applies the score.
    Won,
    /// Another instance claimed it first: a duplicate.
    Lost,
    /// Redis did not answer within `claim_timeout_ms` (or is unreachable): the score is
    /// applied locally, and counted once when the instances sync.
    Unavailable,
}

/// The request path's claims of feedback in Redis: `{namespace}:fb:{request_id}`, set if
/// absent and expiring with the feedback window. The connection is opened by the sync task
/// (a second one, so that a large pull or snapshot never delays a claim): the request path
/// never connects, and waits at most `claim_timeout`.
pub struct Claims {
    conn: Mutex<Option<MultiplexedConnection>>,
    prefix: String,
    timeout: Duration,
    /// Claims won, lost, and unavailable (applied locally).
    pub(super) outcomes: [AtomicU64; 3],
}

impl std::fmt::Debug for Claims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claims")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Claims {
    pub(super) fn new(prefix: String, timeout: Duration) -> Claims {
        Claims {
            conn: Mutex::new(None),
            prefix,
            timeout,
            outcomes: Default::default(),
        }
    }

    pub(super) fn publish(&self, conn: Option<MultiplexedConnection>) {
        if let Ok(mut c) = self.conn.lock() {
            *c = conn;
        }
    }

    /// The connection, when the sync task has one (also the shared capacity counts').
    pub(super) fn connection(&self) -> Option<MultiplexedConnection> {
        self.conn.lock().ok().and_then(|c| c.clone())
    }

    /// How long a request waits on Redis.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Claims the feedback of `request_id` for `window` (the feedback TTL).
    pub async fn claim(&self, request_id: &str, window: Millis) -> Claim {
        let outcome = match self.connection() {
            None => Claim::Unavailable,
            Some(mut conn) => {
                let mut set = redis::cmd("SET");
                set.arg(format!("{}{request_id}", self.prefix))
                    .arg(1)
                    .arg("NX")
                    .arg("PX")
                    .arg(window.0.ceil().max(1.0) as u64);
                match tokio::time::timeout(
                    self.timeout,
                    set.query_async::<Option<String>>(&mut conn),
                )
                .await
                {
                    Ok(Ok(Some(_))) => Claim::Won,
                    Ok(Ok(None)) => Claim::Lost,
                    Ok(Err(_)) | Err(_) => Claim::Unavailable,
                }
            }
        };
        let slot = match outcome {
            Claim::Won => 0,
            Claim::Lost => 1,
            Claim::Unavailable => 2,
        };
        self.outcomes[slot].fetch_add(1, Ordering::Relaxed);
        outcome
    }
}
