//! Shared state of a running gateway: the interfaces with their policies and breakers, the
//! contexts of answered requests waiting for quality feedback, and the metrics.
//!
//! The interfaces are one snapshot ([`Interfaces`]) behind an `ArcSwap`: a request loads it
//! once (an atomic load, no lock) and keeps the runtime it started with; a reload
//! (`server::reload`) swaps in a new snapshot.
//!
//! Locks are held only around pure, microsecond-scale core calls (rank, observe, breaker
//! bookkeeping) and never across an `.await`.

use super::metrics::Metrics;
use crate::config::{ConfigSource, GatewayConfig, InterfaceConfig, InterfaceKind};
pub use crate::pending::{Features, PendingContext, PendingFeedback, PendingStore};
use crate::upstream::Upstream;
use equiroute_core::breaker::{Breaker, BreakerConfig};
use equiroute_core::executor::ExecutionLimits;
use equiroute_core::features::Featurizer;
use equiroute_core::policies::{Observation, Policy};
use equiroute_core::{Candidate, Millis, Timestamp};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Instant;

/// One interface at run time.
#[derive(Debug)]
pub struct InterfaceRuntime {
    pub name: String,
    pub kind: InterfaceKind,
    pub candidates: Vec<Candidate>,
    pub upstreams: Vec<Upstream>,
    pub featurizer: Featurizer,
    pub deadline: Option<Millis>,
    pub limits: ExecutionLimits,
    /// Hedged requests and their budget (a token bucket shared by the interface's requests).
    pub hedge: equiroute_core::hedge::HedgeConfig,
    pub hedge_budget: Mutex<equiroute_core::hedge::HedgeBudget>,
    /// Longest silence between two chunks of a relayed stream.
    pub stream_idle: Millis,
    /// How much of a stream is held before anything is sent to the client.
    pub stream_hold: crate::config::first_byte::StreamHold,
    /// How a stream that broke after it was committed goes on.
    pub stream_resume: crate::config::first_byte::StreamResume,
    /// Per candidate: the provider continues a final assistant message (`assistant_prefill`).
    pub prefill: Vec<bool>,
    /// How a streamed attempt's first-byte limit is derived from `first_bytes`.
    pub first_byte: super::ttfb::FirstByteLimit,
    /// Each candidate's first-byte times (streamed attempts), for its first-byte limit.
    pub first_bytes: Mutex<Vec<equiroute_core::estimators::nig::LogLatencyStats>>,
    /// Each candidate's answer times (unstreamed attempts answered), for the limit of an
    /// unstreamed attempt with another candidate left (`FirstByteLimit::answer_limit`).
    pub answer_times: Mutex<Vec<equiroute_core::estimators::nig::LogLatencyStats>>,
    /// Each candidate's capacity: declared caps, what its headers said is left, requests in
    /// flight (see [`super::capacity`]).
    pub capacity: Vec<Arc<super::capacity::ProviderCapacity>>,
    /// The LLM-as-judge, when configured.
    pub judge: Option<Arc<crate::feedback::judge::Judge>>,
    /// Ranks take the read side (they run in parallel); observations the write side. The
    /// request path only tries the write side: see `deferred`.
    pub policy: RwLock<Box<dyn Policy>>,
    /// Attempt observations that found the policy locked: queued here instead of waiting (a
    /// ranking thread descheduled while it holds the read side would otherwise stall every
    /// request behind it), applied and journaled, in order, by the next holder of the write
    /// side (`AppState::policy_mut`, or the next attempt that gets it).
    deferred: Mutex<Vec<Observation>>,
    /// `deferred.len()`, readable without the lock (updated under it).
    deferred_len: AtomicUsize,
    pub breakers: Mutex<Vec<Breaker>>,
    pub breaker_config: BreakerConfig,
    /// How often each candidate was the first choice.
    pub first_choices: Vec<AtomicU64>,
    /// The shadow policy and the canary rollout, when configured (see [`super::arms`]).
    pub arms: super::arms::Arms,
    /// The task classes learnt in slices of their own (`task_classes`); `None`: any.
    pub task_classes: Option<Vec<String>>,
    /// Recent traffic, for the dashboard (fixed size).
    pub history: super::history::History,
    /// The interface's series every request records (see [`super::metrics::Meters`]).
    pub meters: super::metrics::Meters,
    /// A reload replaced or removed this runtime: the requests still on it finish, and
    /// what they keep for feedback moves to the interface's current runtime.
    retired: AtomicBool,
}

impl InterfaceRuntime {
    /// The runtime of the interface `cfg`, from its policy's priors, its upstreams on
    /// `wiring`'s connection pool, recording into `metrics`.
    ///
    /// # Errors
    /// A policy or featurizer that cannot be built (already checked by config loading).
    pub fn new(
        cfg: &InterfaceConfig,
        wiring: &crate::upstream::http::Wiring,
        keys: &[super::ops::KeyRow],
        metrics: &Metrics,
    ) -> Result<InterfaceRuntime, equiroute_core::ConfigError> {
        let candidates: Vec<Candidate> =
            cfg.providers.iter().map(|p| p.candidate.clone()).collect();
        let policy =
            cfg.policy
                .build_with_floor(&candidates, cfg.feature_dim, &cfg.exploration_floor)?;
        Ok(InterfaceRuntime {
            name: cfg.name.clone(),
            kind: cfg.kind,
            upstreams: cfg
                .providers
                .iter()
                .map(|p| {
                    Upstream::new(
                        &p.candidate.id.0,
                        p.candidate.tier,
                        &p.upstream,
                        &wiring.client,
                        &wiring.redactor,
                    )
                    .with_unsupported_params(p.unsupported_params)
                })
                .collect(),
            featurizer: Featurizer::new(cfg.feature_dim)?.with_max_words(cfg.feature_max_words)?,
            deadline: cfg.deadline,
            limits: cfg.limits,
            hedge: cfg.hedge,
            hedge_budget: Mutex::new(equiroute_core::hedge::HedgeBudget::new(&cfg.hedge)),
            stream_idle: cfg.stream_idle,
            stream_hold: cfg.stream_hold,
            stream_resume: cfg.stream_resume,
            prefill: cfg.providers.iter().map(|p| p.assistant_prefill).collect(),
            first_byte: cfg.first_byte,
            first_bytes: Mutex::new(vec![
                equiroute_core::estimators::nig::LogLatencyStats::default();
                candidates.len()
            ]),
            answer_times: Mutex::new(vec![
                equiroute_core::estimators::nig::LogLatencyStats::default();
                candidates.len()
            ]),
            capacity: cfg
                .providers
                .iter()
                .map(|p| super::capacity::ProviderCapacity::new(p.caps))
                .collect(),
            judge: cfg
                .judge
                .as_ref()
                .map(|j| Arc::new(crate::feedback::judge::Judge::new(j, wiring.clone()))),
            arms: super::arms::Arms::new(cfg)?,
            policy: RwLock::new(policy),
            deferred: Mutex::new(Vec::new()),
            deferred_len: AtomicUsize::new(0),
            breakers: Mutex::new(vec![Breaker::default(); candidates.len()]),
            breaker_config: cfg.breaker,
            first_choices: candidates.iter().map(|_| AtomicU64::new(0)).collect(),
            task_classes: cfg.task_classes.clone(),
            history: super::history::History::new(candidates.len(), keys.to_vec()),
            meters: metrics.meters(&cfg.name, candidates.iter().map(|c| c.id.0.as_str())),
            retired: AtomicBool::new(false),
            candidates,
        })
    }

    /// The live policy's name (a promoted canary's once promoted).
    #[must_use]
    pub fn policy_name(&self) -> &'static str {
        self.arms.live_name()
    }

    /// Marks this runtime as replaced or removed by a reload.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// Whether a reload replaced or removed this runtime.
    #[must_use]
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// The index of the candidate called `id`.
    #[must_use]
    pub fn index_of(&self, id: &str) -> Option<usize> {
        self.candidates.iter().position(|c| c.id.0 == id)
    }
}

impl super::arms::Interface for InterfaceRuntime {
    fn name(&self) -> &str {
        &self.name
    }
    fn candidates(&self) -> &[Candidate] {
        &self.candidates
    }
    fn live_policy(&self) -> &RwLock<Box<dyn Policy>> {
        &self.policy
    }
    fn arms(&self) -> &super::arms::Arms {
        &self.arms
    }
}

/// The interfaces by name: the part of the state a reload swaps as a whole.
pub type Interfaces = BTreeMap<String, Arc<InterfaceRuntime>>;

/// The configuration a gateway serves, and its version.
#[derive(Debug)]
pub struct Configured {
    /// What the interfaces were built from: a reload compares the next configuration with it.
    pub config: GatewayConfig,
    /// 1 at start, one more at each applied reload.
    pub version: u64,
    /// When it was loaded (wall clock, milliseconds since the Unix epoch).
    pub loaded_unix_ms: f64,
}

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// Read once per request ([`AppState::interfaces`], [`AppState::interface`]); swapped
    /// whole by a reload.
    interfaces: arc_swap::ArcSwap<Interfaces>,
    /// The connection pool and redactor the upstreams are built with (a reload builds the
    /// new interfaces' upstreams on the same pool).
    pub wiring: crate::upstream::http::Wiring,
    /// The keys that get a row in the operations view (keys need a restart to change).
    pub key_rows: Vec<super::ops::KeyRow>,
    /// The configuration served and its version; held while a reload applies, so reloads
    /// happen one at a time.
    pub configured: Mutex<Configured>,
    /// Where a reload reads the configuration again (set once by whoever started the
    /// gateway; none: the configuration was given in memory and cannot be reloaded).
    pub source: OnceLock<ConfigSource>,
    pub pending: Mutex<PendingStore>,
    pub metrics: Metrics,
    /// The configured keys, what each may do, and each one's feedback rate.
    pub keys: super::auth::Keys,
    /// Every secret of the configuration and the credential shapes: what any text of an
    /// upstream's passes through before a client, a log line, a span or the audit log sees it.
    pub redactor: Arc<crate::redact::Redactor>,
    /// The rate limits of the log lines a client can trigger at will.
    pub logs: super::repeated::RepeatedLogs,
    /// The decision audit log, when configured.
    pub audit: Option<super::audit::AuditLog>,
    pub feedback_ttl: Millis,
    /// The journal and sync status when learning state is shared through Redis.
    pub shared: Option<crate::shared::SharedHandle>,
    epoch: Instant,
    /// Wall-clock time at `epoch`; `now()` advances monotonically from it.
    started_unix_ms: f64,
    requests: AtomicU64,
    seed: u64,
    /// A full state dump is being built (`?full=true`: one at a time).
    pub full_dump_busy: std::sync::atomic::AtomicBool,
}

impl AppState {
    /// The state of a gateway configured by `cfg`; `seed` seeds every random choice.
    ///
    /// # Errors
    /// A policy or featurizer that cannot be built (already checked by config loading).
    pub fn new(cfg: &GatewayConfig, seed: u64) -> Result<AppState, equiroute_core::ConfigError> {
        // One connection pool and one redactor for every HTTP upstream.
        let wiring = crate::upstream::http::Wiring {
            client: crate::upstream::client::HttpClient::new(),
            redactor: Arc::new(crate::redact::Redactor::new(cfg.secret_values())),
        };
        let started_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0);
        // The keys that send traffic get a row in the operations view (configured: bounded).
        let key_rows: Vec<super::ops::KeyRow> = cfg
            .keys
            .iter()
            .filter(|k| k.grant.role.sends_traffic())
            .map(|k| super::ops::KeyRow {
                label: k.grant.label.clone(),
                tenant: k.grant.tenant.clone(),
            })
            .collect();
        let metrics = Metrics::default();
        metrics.start_at_zero(cfg);
        let mut interfaces = BTreeMap::new();
        for i in &cfg.interfaces {
            interfaces.insert(
                i.name.clone(),
                Arc::new(InterfaceRuntime::new(i, &wiring, &key_rows, &metrics)?),
            );
        }
        metrics.config_loaded(1, started_unix_ms);
        let keys = super::auth::Keys::new(
            &cfg.keys,
            cfg.feedback_rate,
            cfg.connections.max_in_flight_per_key,
        )
        .counted(metrics.refusals("too_many_requests_in_flight"));
        Ok(AppState {
            interfaces: arc_swap::ArcSwap::from_pointee(interfaces),
            configured: Mutex::new(Configured {
                config: cfg.clone(),
                version: 1,
                loaded_unix_ms: started_unix_ms,
            }),
            source: OnceLock::new(),
            pending: Mutex::new(PendingStore::new(cfg.max_pending_feedback)),
            logs: super::repeated::RepeatedLogs::new(&metrics),
            metrics,
            keys,
            redactor: wiring.redactor.clone(),
            wiring,
            key_rows,
            audit: None,
            feedback_ttl: cfg.feedback_ttl,
            shared: match &cfg.state {
                Some(crate::config::StateConfig::Redis(r)) => {
                    Some(crate::shared::SharedHandle::new(r))
                }
                _ => None,
            },
            epoch: Instant::now(),
            started_unix_ms,
            requests: AtomicU64::new(0),
            seed,
            full_dump_busy: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The interfaces served now: one atomic load, no lock. A request reads them once and
    /// keeps what it found (a reload swaps in new ones beside it, never under it); keep the
    /// guard for a moment, not across an `.await` ([`AppState::interface`] clones one out).
    pub fn interfaces(&self) -> arc_swap::Guard<Arc<Interfaces>> {
        self.interfaces.load()
    }

    /// The interfaces served now, for the caller to keep across an `.await`.
    #[must_use]
    pub fn interfaces_full(&self) -> Arc<Interfaces> {
        self.interfaces.load_full()
    }

    /// The configuration's version and when it was loaded, as the dashboard shows them:
    /// `{"version": N, "loaded_unix_ms": T}`.
    #[must_use]
    pub fn config_version(&self) -> serde_json::Value {
        self.configured.lock().map_or(
            serde_json::Value::Null,
            |c| serde_json::json!({"version": c.version, "loaded_unix_ms": c.loaded_unix_ms}),
        )
    }

    /// The interface called `name` served now, for the caller to keep as long as it needs.
    #[must_use]
    pub fn interface(&self, name: &str) -> Option<Arc<InterfaceRuntime>> {
        self.interfaces.load().get(name).cloned()
    }

    /// Where a context kept for feedback on `iface`'s candidate `candidate` goes: the same
    /// index, unless a reload retired `iface` (a request that finished on it after the swap):
    /// then the same provider's index in the interface's current runtime, `None` when that
    /// runtime lacks it or takes features of another size.
    #[must_use]
    pub fn feedback_target(&self, iface: &InterfaceRuntime, candidate: usize) -> Option<usize> {
        if !iface.is_retired() {
            return Some(candidate);
        }
        let now = self.interface(&iface.name)?;
        if now.featurizer.dim() != iface.featurizer.dim() {
            return None;
        }
        now.index_of(&iface.candidates.get(candidate)?.id.0)
    }

    /// Serves `next` from now on; requests in flight keep the runtimes they hold.
    pub fn swap_interfaces(&self, next: Interfaces) {
        self.interfaces.store(Arc::new(next));
    }

    /// Wall-clock milliseconds since the Unix epoch: the clock the core sees. Wall time (not
    /// time since start) so that learning state saved by one run still decays correctly in
    /// the next.
    #[must_use]
    pub fn now(&self) -> Timestamp {
        self.at(Instant::now())
    }

    /// [`Self::now`] at `instant`, an instant the caller read anyway (one clock read serves
    /// both). An instant before the gateway started counts as its start.
    #[must_use]
    pub fn at(&self, instant: Instant) -> Timestamp {
        let since_start = instant.saturating_duration_since(self.epoch).as_secs_f64() * 1000.0;
        Timestamp(self.started_unix_ms + since_start)
    }

    /// Wall-clock milliseconds since the Unix epoch when this gateway started: the start of
    /// the window of its in-memory counters (first choices, metrics).
    #[must_use]
    pub fn started_unix_ms(&self) -> f64 {
        self.started_unix_ms
    }

    /// A new request number and id. The number seeds the request's random choices
    /// ([`AppState::seed_for`], reproducible from the gateway's seed); the id is 128 bits from
    /// a CSPRNG (`rand`'s thread generator: `ChaCha12`, seeded and reseeded from the OS), so that
    /// no caller can guess another's id from its own.
    pub fn next_request(&self) -> (u64, String) {
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        let id: u128 = rand::Rng::random(&mut rand::rng());
        (n, request_id(id))
    }

    /// A seed for request number `n`'s random choices.
    #[must_use]
    pub fn seed_for(&self, n: u64) -> u64 {
        self.seed ^ n.wrapping_mul(0xbf58_476d_1ce4_e5b9)
    }

    /// Drops contexts older than twice the feedback TTL (expired ones are kept for one more
    /// TTL so that late feedback gets a clear 410 rather than a 404).
    pub fn prune_pending(&self, now: Timestamp) {
        if let Ok(mut p) = self.pending.lock() {
            p.prune(now, 2.0 * self.feedback_ttl.0);
        }
    }
}

/// A poisoned lock: a handler panicked while holding it.
pub use super::error::Poisoned;

pub use super::metrics::transition_name;

impl AppState {
    /// Opens a breaker until `until` because another instance opened its own (`pinned`: by
    /// a `Retry-After`).
    pub fn open_breaker(&self, iface: &str, candidate: usize, until: Timestamp, pinned: bool) {
        let Some(i) = self.interface(iface) else {
            return;
        };
        let Ok(mut breakers) = i.breakers.lock() else {
            return;
        };
        if let Some(t) = breakers
            .get_mut(candidate)
            .and_then(|b| b.open_until(until, pinned))
        {
            self.metrics
                .breaker(&i.name, &i.candidates[candidate].id.0, transition_name(t));
        }
    }
}

impl InterfaceRuntime {
    /// Queues an attempt observation that found the policy locked (see `deferred`).
    ///
    /// # Errors
    /// A poisoned queue.
    pub(super) fn defer(&self, obs: Observation) -> Result<(), ()> {
        let mut queue = self.deferred.lock().map_err(|_| ())?;
        queue.push(obs);
        self.deferred_len.store(queue.len(), Ordering::Release);
        Ok(())
    }

    /// Takes the queued observations, oldest first, for the holder of the write side to
    /// apply (nothing, without taking the lock, when none waits).
    pub(super) fn take_deferred(&self) -> Vec<Observation> {
        if self.deferred_len.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        match self.deferred.lock() {
            Ok(mut queue) => {
                self.deferred_len.store(0, Ordering::Release);
                std::mem::take(&mut *queue)
            }
            Err(_) => Vec::new(),
        }
    }
}

/// The summaries of rate-limited log lines ([`super::repeated`]).
/// Writes the summaries of held-back lines every [`super::repeated::INTERVAL`], even when nothing follows a
/// burst; runs until aborted (the gateway's `serve` aborts it and writes what is left).
pub async fn keep_summing_up(state: std::sync::Arc<AppState>) {
    loop {
        tokio::time::sleep(super::repeated::INTERVAL).await;
        state.logs.flush(false);
    }
}

/// The id of a request numbered `id` at random: `req-` and 32 lowercase hex digits, two a
/// byte into a buffer (`format!` costs about three times as much, on every request; a `char`
/// pushed per digit, with a 128-bit shift each, twice as much).
fn request_id(id: u128) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut buf = *b"req-00000000000000000000000000000000";
    for (i, byte) in id.to_be_bytes().into_iter().enumerate() {
        buf[4 + 2 * i] = HEX[usize::from(byte >> 4)];
        buf[5 + 2 * i] = HEX[usize::from(byte & 0xf)];
    }
    // Only ASCII was written, so the check passes.
    std::str::from_utf8(&buf).unwrap_or_default().to_owned()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use equiroute_core::{AttemptOutcome, SlicePath};

    #[test]
    fn a_request_id_is_req_and_32_lowercase_hex_digits_of_its_number() {
        for id in [
            0,
            1,
            0xabc,
            u128::MAX,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        ] {
            assert_eq!(request_id(id), format!("req-{id:032x}"));
        }
    }

    #[test]
    fn a_read_instant_gives_the_time_now_gives_at_that_instant() {
        let app = app_seeded(1);
        let before = app.now();
        let instant = Instant::now();
        let at = app.at(instant);
        let after = app.now();
        assert!(
            before.0 <= at.0 && at.0 <= after.0,
            "{before:?} {at:?} {after:?}"
        );
        // A later instant is later by the time between them, to the microsecond.
        let later = app.at(instant + std::time::Duration::from_millis(1500));
        assert!((later.0 - at.0 - 1500.0).abs() < 1e-3, "{at:?} {later:?}");
        // The gateway's start: its wall-clock start, also for an instant before it.
        assert!((app.at(app.epoch).0 - app.started_unix_ms()).abs() < 1e-9);
        let earlier = app.epoch.checked_sub(std::time::Duration::from_secs(1));
        if let Some(earlier) = earlier {
            assert!((app.at(earlier).0 - app.started_unix_ms()).abs() < 1e-9);
        }
    }

    /// A gateway of one simulated provider, seeded with `seed` (the server's unit tests').
    pub(in crate::server) fn app_seeded(seed: u64) -> AppState {
        let text = "[interfaces.chat]\nkind = \"chat\"\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 5, p95_ms = 9 } }\n";
        let cfg = crate::config::load(text, "t.toml", &|_| None).unwrap_or_else(|e| panic!("{e}"));
        AppState::new(&cfg, seed).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The ids of `n` requests on a fresh gateway seeded with `seed`, as numbers.
    fn ids(seed: u64, n: usize) -> Vec<u128> {
        let app = app_seeded(seed);
        (0..n)
            .map(|k| {
                let (number, id) = app.next_request();
                assert_eq!(number, k as u64, "numbers still count requests");
                let hex = id.strip_prefix("req-").unwrap_or_else(|| panic!("{id}"));
                assert_eq!(hex.len(), 32, "{id}");
                assert!(
                    hex.bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                    "{id}"
                );
                u128::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("{id}: {e}"))
            })
            .collect()
    }

    #[test]
    fn request_ids_are_128_random_bits_unrelated_to_the_seed_and_to_each_other() {
        let a = ids(7, 1000);
        // All distinct.
        let distinct: std::collections::HashSet<u128> = a.iter().copied().collect();
        assert_eq!(distinct.len(), 1000);
        // Not a function of the gateway's seed and the request number: another gateway with
        // the same seed issues other ids (the decisions' seeds stay reproducible).
        let b = ids(7, 1000);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        // No arithmetic relation between consecutive ids: neither their differences nor their
        // XORs repeat (a counter, an LCG or a multiplied counter repeats one or the other).
        let steps: std::collections::HashSet<u128> =
            a.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
        let flips: std::collections::HashSet<u128> = a.windows(2).map(|w| w[1] ^ w[0]).collect();
        assert_eq!((steps.len(), flips.len()), (999, 999));
        // Every one of the 128 bits is set in about half of the ids: 500 ± 100 is more than six
        // standard deviations (15.8) either side, so a fair generator fails one in ~10^8 runs;
        // 64-bit ids (the high half zero) or a stuck bit fail at once.
        for bit in 0..128 {
            let set = a.iter().filter(|id| (*id >> bit) & 1 == 1).count();
            assert!(
                (400..=600).contains(&set),
                "bit {bit} is set in {set} of 1000 ids"
            );
        }
        assert_eq!(
            app_seeded(7).seed_for(3),
            app_seeded(7).seed_for(3),
            "decisions stay seeded"
        );
    }

    #[test]
    fn an_attempt_that_finds_the_policy_locked_waits_in_the_queue_not_on_the_lock() {
        let text = "[interfaces.chat]\nkind = \"chat\"\nfeature_dim = 8\npolicy = { name = \"lqm-ts\" }\n[[interfaces.chat.providers]]\nid = \"a\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 5, p95_ms = 9 } }\n[[interfaces.chat.providers]]\nid = \"b\"\nkind = \"sim\"\nsim = { latency = { p50_ms = 5, p95_ms = 9 } }\n";
        let cfg = crate::config::load(text, "t.toml", &|_| None).unwrap_or_else(|e| panic!("{e}"));
        let app = AppState::new(&cfg, 1).unwrap_or_else(|e| panic!("{e}"));
        let iface = app.interface("chat").unwrap_or_else(|| panic!("no chat"));
        let iface = &*iface;
        let features = iface.featurizer.featurize("a question");
        let export = || {
            let p = iface.policy.read().unwrap_or_else(|_| panic!("poisoned"));
            serde_json::to_string(&p.export_state()).unwrap_or_default()
        };
        let before = export();
        let failed = AttemptOutcome::with_status(
            900.0,
            equiroute_core::AttemptStatus::ProviderError(equiroute_core::ProviderFailure::Server),
        );
        {
            // A ranking holds the read side: the attempt must neither block nor be lost.
            let _rank = iface.policy.read().unwrap_or_else(|_| panic!("poisoned"));
            for _ in 0..3 {
                app.record_attempt(iface, 1, &features, SlicePath::root(), &failed, None)
                    .unwrap_or_else(|_| panic!("poisoned"));
            }
            assert_eq!(iface.deferred_len.load(Ordering::Acquire), 3);
        }
        assert_eq!(export(), before, "deferred, not yet applied");
        drop(app.policy_mut(iface).unwrap_or_else(|_| panic!("poisoned")));
        assert_eq!(iface.deferred_len.load(Ordering::Acquire), 0);
        let after = export();
        assert_ne!(
            after, before,
            "applied by the next holder of the write side"
        );
        // All three, each once: three attempts and three failures on candidate 1.
        let v: serde_json::Value = serde_json::from_str(&after).unwrap_or_default();
        assert_eq!(
            v["quality"]["heads"]["tries"],
            serde_json::json!([0, 3]),
            "{after}"
        );
        assert_eq!(v["risk"]["failures"][1]["count"], 3, "{after}");
    }
}
