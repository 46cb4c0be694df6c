//! Who is calling, and what the caller may do.
//!
//! Authentication does not only say yes or no: it names the [`Caller`] (the configured key that
//! matched, by its label; never the key), which the handlers take as a request extension. From
//! it follow the request's tenant ([`tenant_of`]: a key bound to a tenant cannot claim another
//! in `x-equiroute-tenant`), the task classes it may name ([`task_class_of`]), whose answered
//! requests it may score ([`Caller::may_score`]) and its share of the feedback rate
//! ([`Keys::take_feedback`]), and its share of the requests in flight ([`Keys::enter`]:
//! `server.max_in_flight_per_key`, so that one key cannot take every connection's worth of
//! requests from many addresses).
//!
//! Which keys open which routes ([`Route`]): the traffic routes take client and judge keys;
//! `/v1/feedback` takes those and the admin keys; the state routes and the dashboard take the
//! admin keys, or the client and judge keys when no admin key is configured. A route whose keys
//! are not configured is open, and its callers are [`Caller::Anonymous`]. Keys are compared in
//! constant time with every configured key.

use super::error::{echo, ApiError};
use crate::config::{FeedbackRate, KeyConfig, KeyGrant, KeyRole};
use axum::http::{HeaderMap, HeaderName, StatusCode};
use prometheus_client::metrics::counter::Counter;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The tenant header.
pub const TENANT_HEADER: &str = "x-equiroute-tenant";
/// The task class header.
pub const TASK_CLASS_HEADER: &str = "x-equiroute-task-class";
// Both read by name, made once: a name given as text is parsed again at every lookup.
const TENANT: HeaderName = HeaderName::from_static(TENANT_HEADER);
const TASK_CLASS: HeaderName = HeaderName::from_static(TASK_CLASS_HEADER);

/// Who made a request.
#[derive(Clone, Debug)]
pub enum Caller {
    /// Nobody known: the route's keys are not configured (a gateway for local use).
    Anonymous,
    /// The configured key at this index of [`Keys`], and what it may do.
    Key(usize, Arc<KeyGrant>),
    /// The gateway itself: the interfaces' built-in judge, or code in the process.
    Internal,
}

impl Caller {
    /// The key's label, if a key called.
    #[must_use]
    pub fn label(&self) -> Option<&str> {
        match self {
            Caller::Key(_, grant) => Some(&grant.label),
            Caller::Anonymous | Caller::Internal => None,
        }
    }

    /// The key's label, shared, if a key called: what a request carries as its owner.
    #[must_use]
    pub fn owner(&self) -> Option<Arc<str>> {
        match self {
            Caller::Key(_, grant) => Some(grant.label.clone()),
            Caller::Anonymous | Caller::Internal => None,
        }
    }

    /// What the key may do, if a key called.
    #[must_use]
    pub fn grant(&self) -> Option<&KeyGrant> {
        match self {
            Caller::Key(_, grant) => Some(grant),
            Caller::Anonymous | Caller::Internal => None,
        }
    }

    /// Whether this caller may score a request made by `owner` (a key's label; `None`: an
    /// unbound request, made without a key or before requests were bound). A key scores its
    /// own requests, a judge or admin key and the gateway any; an anonymous caller only
    /// unbound ones, and a client key no unbound one.
    #[must_use]
    pub fn may_score(&self, owner: Option<&str>) -> bool {
        match self {
            Caller::Internal => true,
            Caller::Key(_, grant) => {
                grant.role.scores_any_request() || owner == Some(&*grant.label)
            }
            Caller::Anonymous => owner.is_none(),
        }
    }
}

/// A kind of route, by the keys that open it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `/v1/chat/completions`, `/v1/tools/…`, `/v1/models…`.
    Traffic,
    /// `/v1/feedback`.
    Feedback,
    /// The state and rollout routes and the dashboard.
    Admin,
}

/// A token bucket of one caller's feedback.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Option<Instant>,
}

/// The configured keys, and each one's feedback bucket.
#[derive(Debug)]
pub struct Keys {
    accepted: Vec<(crate::config::Secret, Arc<KeyGrant>)>,
    /// Some key opens the traffic routes (else they are open).
    any_traffic: bool,
    /// Some key is an admin key (the state routes then take only those).
    any_admin: bool,
    rate: Option<FeedbackRate>,
    /// One per key, then one shared by anonymous callers; empty without a rate.
    buckets: Vec<Mutex<Bucket>>,
    /// Each key's requests in flight.
    in_flight: Vec<Arc<AtomicUsize>>,
    max_in_flight: usize,
    /// Requests refused for their key's share (`equiroute_refusals_total`).
    refused: Counter,
}

/// A request's seat among its key's requests in flight, given back when dropped (with the
/// answer's last byte, for a stream).
#[derive(Debug)]
pub struct KeySeat(Arc<AtomicUsize>);

impl Drop for KeySeat {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Keys {
    /// The accepted `keys`, with the feedback `rate` per key and at most `max_in_flight`
    /// requests in flight per key.
    #[must_use]
    pub fn new(keys: &[KeyConfig], rate: Option<FeedbackRate>, max_in_flight: usize) -> Keys {
        let buckets = rate.map_or(0, |_| keys.len() + 1);
        Keys {
            accepted: keys
                .iter()
                .map(|k| (k.secret.clone(), Arc::new(k.grant.clone())))
                .collect(),
            any_traffic: keys.iter().any(|k| k.grant.role.sends_traffic()),
            any_admin: keys.iter().any(|k| k.grant.role == KeyRole::Admin),
            rate,
            buckets: (0..buckets)
                .map(|_| {
                    Mutex::new(Bucket {
                        tokens: rate.map_or(0.0, |r| r.burst),
                        at: None,
                    })
                })
                .collect(),
            in_flight: keys.iter().map(|_| Arc::default()).collect(),
            max_in_flight,
            refused: Counter::default(),
        }
    }

    /// The keys with their refusals counted in `refused`.
    #[must_use]
    pub fn counted(self, refused: Counter) -> Keys {
        Keys { refused, ..self }
    }

    /// A seat for a request of `caller` among its key's requests in flight; `None` for a
    /// caller without a key.
    ///
    /// # Errors
    /// The key has `server.max_in_flight_per_key` requests in flight: a 429
    /// (`too_many_requests_in_flight`, with `Retry-After: 1`).
    pub fn enter(&self, caller: &Caller) -> Result<Option<KeySeat>, ApiError> {
        let Caller::Key(i, _) = caller else {
            return Ok(None);
        };
        let Some(count) = self.in_flight.get(*i) else {
            return Ok(None);
        };
        if count.fetch_add(1, Ordering::AcqRel) >= self.max_in_flight {
            count.fetch_sub(1, Ordering::AcqRel);
            self.refused.inc();
            return Err(ApiError {
                retry_after_s: Some(1),
                ..ApiError::busy(
                    "too_many_requests_in_flight",
                    format!(
                        "this key has its maximum of {} requests in flight (server.max_in_flight_per_key): wait for an answer, or retry in a second",
                        self.max_in_flight
                    ),
                )
            });
        }
        Ok(Some(KeySeat(count.clone())))
    }

    /// Whether admin keys are configured (the state routes then take only those).
    #[must_use]
    pub fn has_admin_keys(&self) -> bool {
        self.any_admin
    }

    /// The caller presenting `given` on `route`, or `None` when `given` does not open it.
    /// Every configured key is compared, in constant time each.
    #[must_use]
    pub fn identify(&self, given: &[u8], route: Route) -> Option<Caller> {
        let opens = |role: KeyRole| match route {
            Route::Feedback => true,
            Route::Admin if self.any_admin => role == KeyRole::Admin,
            Route::Traffic | Route::Admin => role.sends_traffic(),
        };
        let (mut found, mut admin) = (None, None);
        for (i, (secret, grant)) in self.accepted.iter().enumerate() {
            if same(given, secret.0.as_bytes()) & opens(grant.role) {
                if grant.role == KeyRole::Admin {
                    admin = admin.or(Some(i));
                } else {
                    found = found.or(Some(i));
                }
            }
        }
        // A key declared both as a client key and as an admin key scores as the admin.
        if let Some(i) = admin.or(found) {
            return Some(Caller::Key(i, self.accepted[i].1.clone()));
        }
        let open = match route {
            Route::Traffic | Route::Feedback => !self.any_traffic,
            Route::Admin => self.accepted.is_empty(),
        };
        open.then_some(Caller::Anonymous)
    }

    /// The caller of a request with `headers` (its bearer key, or its `x-api-key` when
    /// `x_api_key` and there is no bearer key) on `route`.
    #[must_use]
    pub fn caller(&self, headers: &HeaderMap, route: Route, x_api_key: bool) -> Option<Caller> {
        let key = bearer(headers)
            .or_else(|| {
                x_api_key
                    .then(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
                    .flatten()
            })
            .unwrap_or("");
        self.identify(key.as_bytes(), route)
    }

    /// Takes one score from `caller`'s feedback bucket; when it is empty, the 429 to answer,
    /// with the seconds until the next score is accepted.
    ///
    /// # Errors
    /// The bucket is empty (`feedback_rate_limited`, with `Retry-After`).
    pub fn take_feedback(&self, caller: &Caller, now: Instant) -> Result<(), ApiError> {
        let Some(rate) = self.rate else {
            return Ok(());
        };
        let index = match caller {
            Caller::Internal => return Ok(()),
            Caller::Key(i, _) => *i,
            Caller::Anonymous => self.accepted.len(),
        };
        let Some(Ok(mut bucket)) = self.buckets.get(index).map(Mutex::lock) else {
            return Ok(());
        };
        let refill = bucket
            .at
            .map_or(0.0, |at| now.saturating_duration_since(at).as_secs_f64());
        bucket.tokens = (bucket.tokens + refill * rate.per_second).min(rate.burst);
        bucket.at = Some(now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return Ok(());
        }
        let wait = ((1.0 - bucket.tokens) / rate.per_second).ceil().max(1.0);
        Err(ApiError {
            retry_after_s: Some(wait.min(f64::from(u16::MAX)) as u16),
            ..ApiError::busy(
                "feedback_rate_limited",
                format!(
                    "this key has posted more feedback than server.feedback_rate_per_key allows ({} per second, {} at once): retry after the seconds in Retry-After",
                    rate.per_second, rate.burst
                ),
            )
        })
    }
}

/// The bearer key of a request (`Authorization: Bearer <key>`).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// Constant-time equality, so a wrong key's timing says nothing about the right one.
#[must_use]
pub fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, x) in a.iter().enumerate() {
        diff |= usize::from(x ^ b.get(i % b.len().max(1)).copied().unwrap_or(0));
    }
    diff == 0
}

/// The request's tenant: the key's when it is bound to one (a header naming another is
/// refused with 403), else `x-equiroute-tenant`. A header that is not one tenant name (not
/// text, not a valid name, or sent twice) is a 400; an empty one is no tenant.
///
/// # Errors
/// 400 `invalid_tenant`, 403 `tenant_not_allowed`.
pub fn tenant_of(headers: &HeaderMap, caller: &Caller) -> Result<Option<String>, ApiError> {
    let invalid = |why: &str| {
        ApiError::bad_request(
            "invalid_tenant",
            Some(TENANT_HEADER),
            format!(
                "`{TENANT_HEADER}` {why}: send one tenant name ({}), or leave the header out",
                crate::config::TENANT_FIX
            ),
        )
    };
    let mut values = headers.get_all(TENANT).iter();
    let claimed = match (values.next(), values.next()) {
        (None, _) => None,
        (Some(_), Some(_)) => return Err(invalid("is sent more than once")),
        (Some(v), None) => {
            let text = v
                .to_str()
                .map_err(|_| invalid("is not text (only visible ASCII is accepted)"))?
                .trim();
            if text.is_empty() {
                None
            } else if crate::config::valid_tenant(text) {
                Some(text)
            } else {
                return Err(invalid(&format!("`{}` is not a tenant name", echo(text))));
            }
        }
    };
    let bound = caller.grant().and_then(|g| g.tenant.as_deref());
    match (bound, claimed) {
        (Some(own), Some(other)) if own != other => Err(ApiError {
            param: Some(TENANT_HEADER.into()),
            ..ApiError::invalid(
                StatusCode::FORBIDDEN,
                "tenant_not_allowed",
                format!(
                    "this key is bound to tenant `{own}` and `{TENANT_HEADER}` names `{}`: leave the header out (the key's tenant applies), or call with a key of that tenant",
                    echo(other)
                ),
            )
        }),
        (Some(own), _) => Ok(Some(own.to_owned())),
        (None, claimed) => Ok(claimed.map(str::to_owned)),
    }
}

/// The request's task class (`x-equiroute-task-class`, trimmed; none when absent, empty or
/// not text). A key restricted to task classes may name only those (403 otherwise); without
/// the header its requests are learnt from in the unclassed slice.
///
/// # Errors
/// 403 `task_class_not_allowed`.
pub fn task_class_of(headers: &HeaderMap, caller: &Caller) -> Result<Option<String>, ApiError> {
    let class = headers
        .get(TASK_CLASS)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty());
    let allowed = caller.grant().and_then(|g| g.task_classes.as_deref());
    match (class, allowed) {
        (Some(c), Some(allowed)) if !allowed.iter().any(|a| a == c) => Err(ApiError {
            param: Some(TASK_CLASS_HEADER.into()),
            ..ApiError::invalid(
                StatusCode::FORBIDDEN,
                "task_class_not_allowed",
                format!(
                    "this key may name only the task classes {} in `{TASK_CLASS_HEADER}`, not `{}`: send one of them, or leave the header out (the request is then learnt from without a class)",
                    allowed.join(", "),
                    echo(c)
                ),
            )
        }),
        (class, _) => Ok(class.map(str::to_owned)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::config::Secret;

    fn key(value: &str, label: &str, role: KeyRole) -> KeyConfig {
        KeyConfig {
            secret: Secret(value.into()),
            grant: KeyGrant {
                label: label.into(),
                role,
                tenant: None,
                task_classes: None,
            },
        }
    }

    /// Keys `ka` (client `A`), `kj` (judge `J`) and `kx` (admin `X`).
    fn client_judge_admin() -> Keys {
        Keys::new(
            &[
                key("ka", "A", KeyRole::Client),
                key("kj", "J", KeyRole::Judge),
                key("kx", "X", KeyRole::Admin),
            ],
            None,
            2,
        )
    }

    #[test]
    fn each_route_takes_its_keys_and_names_the_caller_by_label() {
        let keys = client_judge_admin();
        let label = |given: &str, route| {
            keys.identify(given.as_bytes(), route)
                .map(|c| c.label().map(str::to_owned))
        };
        assert_eq!(label("ka", Route::Traffic), Some(Some("A".into())));
        assert_eq!(label("kj", Route::Traffic), Some(Some("J".into())));
        assert_eq!(
            label("kx", Route::Traffic),
            None,
            "admin keys send no traffic"
        );
        assert_eq!(label("kx", Route::Feedback), Some(Some("X".into())));
        assert_eq!(label("ka", Route::Admin), None, "admin keys are configured");
        assert_eq!(label("kx", Route::Admin), Some(Some("X".into())));
        assert_eq!(label("k", Route::Traffic), None, "a prefix is not the key");
        assert_eq!(label("", Route::Feedback), None);
        // With no admin key, the client keys open the state routes; with no key, all is open.
        let only_clients = Keys::new(&[key("ka", "TEAM_A", KeyRole::Client)], None, 2);
        assert!(only_clients.identify(b"ka", Route::Admin).is_some());
        let open = Keys::new(&[], None, 2);
        assert!(matches!(
            open.identify(b"", Route::Admin),
            Some(Caller::Anonymous)
        ));
        assert!(matches!(
            open.identify(b"x", Route::Feedback),
            Some(Caller::Anonymous)
        ));
    }

    #[test]
    fn a_key_scores_its_own_requests_judges_and_admins_any_and_anonymous_only_unbound() {
        let keys = client_judge_admin();
        let who = |k: &str| keys.identify(k.as_bytes(), Route::Feedback).unwrap();
        assert!(who("ka").may_score(Some("A")));
        assert!(!who("ka").may_score(Some("B")));
        assert!(
            !who("ka").may_score(None),
            "a client key scores no unbound request"
        );
        for privileged in [who("kj"), who("kx"), Caller::Internal] {
            assert!(privileged.may_score(Some("A")) && privileged.may_score(None));
        }
        assert!(Caller::Anonymous.may_score(None));
        assert!(!Caller::Anonymous.may_score(Some("A")));
    }

    #[test]
    fn a_key_holds_at_most_its_share_of_requests_in_flight_and_gets_each_seat_back() {
        let keys = client_judge_admin();
        let a = keys.identify(b"ka", Route::Traffic).unwrap();
        let j = keys.identify(b"kj", Route::Traffic).unwrap();
        let first = keys.enter(&a).unwrap();
        let second = keys.enter(&a).unwrap();
        assert!(first.is_some() && second.is_some());
        let refused = keys.enter(&a).unwrap_err();
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.code, "too_many_requests_in_flight");
        assert_eq!(refused.retry_after_s, Some(1));
        // Another key has its own share.
        assert!(keys.enter(&j).unwrap().is_some());
        drop(first);
        assert!(
            keys.enter(&a).unwrap().is_some(),
            "a seat given back is free again"
        );
        // A caller without a key holds no seat (its address's share bounds it).
        assert!(keys.enter(&Caller::Anonymous).unwrap().is_none());
    }

    #[test]
    fn the_feedback_bucket_refills_at_the_rate_and_says_when_to_retry() {
        let keys = Keys::new(
            &[
                key("ka", "A", KeyRole::Client),
                key("kb", "B", KeyRole::Client),
            ],
            Some(FeedbackRate {
                per_second: 0.5,
                burst: 2.0,
            }),
            2,
        );
        let (a, b) = (
            keys.identify(b"ka", Route::Feedback).unwrap(),
            keys.identify(b"kb", Route::Feedback).unwrap(),
        );
        let t0 = Instant::now();
        assert!(keys.take_feedback(&a, t0).is_ok());
        assert!(keys.take_feedback(&a, t0).is_ok());
        let refused = keys.take_feedback(&a, t0).unwrap_err();
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        // One token at 0.5 per second: 2 s.
        assert_eq!(refused.retry_after_s, Some(2));
        assert!(
            keys.take_feedback(&b, t0).is_ok(),
            "each key has its own bucket"
        );
        assert!(keys
            .take_feedback(&a, t0 + std::time::Duration::from_secs(2))
            .is_ok());
        assert!(keys.take_feedback(&Caller::Internal, t0).is_ok());
    }
}
