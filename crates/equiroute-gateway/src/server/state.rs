//! Shared state of a running gateway: the interfaces with their policies and breakers, the
//! contexts of answered requests waiting for quality feedback, and the metrics.
//!
//! Locks are held only around pure, microsecond-scale core calls (rank, observe, breaker
//! bookkeeping) and never across an `.await`.

use super::metrics::Metrics;
use crate::config::{GatewayConfig, InterfaceConfig, InterfaceKind};
use crate::upstream::Upstream;
use equiroute_core::breaker::{Breaker, BreakerConfig};
use equiroute_core::executor::ExecutionLimits;
use equiroute_core::features::Featurizer;
use equiroute_core::policies::Policy;
use equiroute_core::{Candidate, Millis, Timestamp};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
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
    /// Longest silence between two chunks of a relayed stream.
    pub stream_idle: Millis,
    /// The LLM-as-judge, when configured.
    pub judge: Option<Arc<crate::feedback::judge::Judge>>,
    /// Ranks take the read side (they run in parallel); observations the write side.
    pub policy: RwLock<Box<dyn Policy>>,
    pub breakers: Mutex<Vec<Breaker>>,
    pub breaker_config: BreakerConfig,
    /// How often each candidate was the first choice.
    pub first_choices: Vec<AtomicU64>,
    pub policy_name: &'static str,
}

impl InterfaceRuntime {
    fn new(
        cfg: &InterfaceConfig,
        client: &reqwest::Client,
    ) -> Result<InterfaceRuntime, equiroute_core::ConfigError> {
        let candidates: Vec<Candidate> =
            cfg.providers.iter().map(|p| p.candidate.clone()).collect();
        let policy = cfg.policy.build(&candidates, cfg.feature_dim)?;
        Ok(InterfaceRuntime {
            name: cfg.name.clone(),
            kind: cfg.kind,
            upstreams: cfg
                .providers
                .iter()
                .map(|p| Upstream::new(&p.candidate.id.0, p.candidate.tier, &p.upstream, client))
                .collect(),
            featurizer: Featurizer::new(cfg.feature_dim)?,
            deadline: cfg.deadline,
            limits: cfg.limits,
            stream_idle: cfg.stream_idle,
            judge: cfg
                .judge
                .as_ref()
                .map(|j| Arc::new(crate::feedback::judge::Judge::new(j, client))),
            policy_name: cfg.policy.kind().as_str(),
            policy: RwLock::new(policy),
            breakers: Mutex::new(vec![Breaker::default(); candidates.len()]),
            breaker_config: BreakerConfig::default(),
            first_choices: candidates.iter().map(|_| AtomicU64::new(0)).collect(),
            candidates,
        })
    }

    /// The index of the candidate called `id`.
    #[must_use]
    pub fn index_of(&self, id: &str) -> Option<usize> {
        self.candidates.iter().position(|c| c.id.0 == id)
    }
}

/// The context of an answered request, kept until its quality score arrives.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PendingFeedback {
    pub interface: String,
    pub candidate: usize,
    pub features: Vec<f64>,
    pub latency: Millis,
    pub at: Timestamp,
    pub consumed: bool,
}

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    pub interfaces: BTreeMap<String, Arc<InterfaceRuntime>>,
    pub pending: Mutex<HashMap<String, PendingFeedback>>,
    pub metrics: Metrics,
    pub api_keys: Vec<crate::config::Secret>,
    pub admin_keys: Vec<crate::config::Secret>,
    /// The decision audit log, when configured.
    pub audit: Option<super::audit::AuditLog>,
    pub feedback_ttl: Millis,
    epoch: Instant,
    /// Wall-clock time at `epoch`; `now()` advances monotonically from it.
    started_unix_ms: f64,
    requests: AtomicU64,
    seed: u64,
}

impl AppState {
    /// The state of a gateway configured by `cfg`; `seed` seeds every random choice.
    ///
    /// # Errors
    /// A policy or featurizer that cannot be built (already checked by config loading).
    pub fn new(cfg: &GatewayConfig, seed: u64) -> Result<AppState, equiroute_core::ConfigError> {
        // One connection pool for every HTTP upstream.
        let client = reqwest::Client::builder()
            .pool_idle_timeout(std::time::Duration::from_secs(90))
            .build()
            .unwrap_or_default();
        let mut interfaces = BTreeMap::new();
        for i in &cfg.interfaces {
            interfaces.insert(i.name.clone(), Arc::new(InterfaceRuntime::new(i, &client)?));
        }
        Ok(AppState {
            interfaces,
            pending: Mutex::new(HashMap::new()),
            metrics: Metrics::default(),
            api_keys: cfg.api_keys.clone(),
            admin_keys: cfg.admin_keys.clone(),
            audit: None,
            feedback_ttl: cfg.feedback_ttl,
            epoch: Instant::now(),
            started_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64() * 1000.0),
            requests: AtomicU64::new(0),
            seed,
        })
    }

    /// Wall-clock milliseconds since the Unix epoch: the clock the core sees. Wall time (not
    /// time since start) so that learning state saved by one run still decays correctly in
    /// the next.
    #[must_use]
    pub fn now(&self) -> Timestamp {
        let since_start = self.epoch.elapsed().as_secs_f64() * 1000.0;
        Timestamp(self.started_unix_ms + since_start)
    }

    /// A new request number and id.
    pub fn next_request(&self) -> (u64, String) {
        let n = self.requests.fetch_add(1, Ordering::Relaxed);
        (
            n,
            format!(
                "req-{:016x}",
                self.seed
                    .wrapping_add(n)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    ^ n
            ),
        )
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
            let horizon = 2.0 * self.feedback_ttl.0;
            p.retain(|_, e| now.0 - e.at.0 <= horizon);
        }
    }
}
