//! A namespace in Redis: its keys, the Lua scripts that change them atomically, stream ids,
//! commands with a timeout, the errors of a shared state, and [`reset`].

use crate::config::RedisStateConfig;
use std::time::Duration;

/// Longest wait for one Redis command before the sync counts Redis as unreachable.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// Appends one batch, unless this instance's batch number was appended already. The acks
/// hash holds, per instance, its last appended batch number and when (Redis's clock, in
/// seconds): `number:seconds` (a bare `number` was written before the time was kept).
pub(super) const PUSH_SCRIPT: &str = r"
local v = redis.call('HGET', KEYS[2], ARGV[1])
local done = v and tonumber(string.match(v, '^%d+')) or 0
if tonumber(ARGV[2]) <= done then return 0 end
local fields = {'i', ARGV[1], 's', ARGV[3], 'b', ARGV[4]}
if #ARGV[5] > 0 then
  table.insert(fields, 'r')
  table.insert(fields, ARGV[5])
end
if #ARGV[6] > 0 then
  table.insert(fields, 'e')
  table.insert(fields, ARGV[6])
end
redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ':' .. redis.call('TIME')[1])
return 1
";

/// How long an instance's acknowledgement is kept after its last append. Every start is a
/// new instance id, so without an end the acks hash would keep one field per start for
/// ever; the acknowledgement only guards a batch resent after its answer was lost, which
/// a live instance does within seconds.
pub(super) const ACK_KEEP_S: u64 = 7 * 24 * 3600;

/// Stores a snapshot if it is newer than the stored one, and trims the stream up to the
/// previous snapshot. Every compaction also drops the acknowledgements of instances that
/// appended nothing for `ARGV[4]` seconds (and those written without a time).
pub(super) const SNAPSHOT_SCRIPT: &str = r"
local now = tonumber(redis.call('TIME')[1])
local acks = redis.call('HGETALL', KEYS[3])
for i = 1, #acks, 2 do
  local t = tonumber(string.match(acks[i + 1], ':(%d+)$') or '0')
  if now - t > tonumber(ARGV[4]) then redis.call('HDEL', KEYS[3], acks[i]) end
end
local function parts(id)
  local ms, seq = string.match(id, '(%d+)-(%d+)')
  return tonumber(ms), tonumber(seq)
end
local cur = redis.call('HGET', KEYS[1], 'id')
if cur then
  local am, as = parts(ARGV[1])
  local bm, bs = parts(cur)
  if am < bm or (am == bm and as <= bs) then return 0 end
end
local trimmed = cur or '0-0'
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'data', ARGV[2], 'seen', ARGV[3], 'trimmed', trimmed, 'rollouts', ARGV[5])
redis.call('XTRIM', KEYS[2], 'MINID', trimmed)
return 1
";

/// Announces instance `ARGV[1]` as live for `ARGV[2]` more milliseconds of Redis's clock
/// (`0`: it leaves), and forgets the instances whose announcement ran out. The live set is
/// what `serve --reset-state` checks: a live instance would write its learning back.
pub(super) const LIVE_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if tonumber(ARGV[2]) > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
";

/// Deletes every key of the namespace (`KEYS[1]` is the live set), unless an instance is
/// live: then returns the live instances and deletes nothing.
const RESET_SCRIPT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local live = redis.call('ZRANGE', KEYS[1], 0, -1)
if #live > 0 then return live end
redis.call('DEL', unpack(KEYS))
return {}
";

/// How long an instance counts as live after its last sync: three sync intervals, at least
/// two seconds (an instance killed without leaving is forgotten after that).
pub(super) fn live_for(sync_interval: Duration) -> Duration {
    (sync_interval * 3).max(Duration::from_secs(2))
}

/// The epoch of the stream, read or created (`fresh:…`) by an instance's first sync.
pub(super) const EPOCH_SCRIPT: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur then return cur end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
";

/// Called by an instance that finds the epoch it knew missing or changed (Redis lost the
/// stream). Unchanged after all: `{0}`. Re-seeded by another instance (`reseed:…`): `{1}`,
/// re-base on its snapshot. Missing, or `fresh:…` (made by an instance that never saw the
/// old stream): this instance claims the re-seed, `{2}`, and its confirmed state becomes
/// the snapshot the new stream starts from (at [`RESEED_ID`], before any entry). Another
/// configuration took the namespace meanwhile: `{3}`.
pub const RECOVER_SCRIPT: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return {0, cur} end
if cur and string.sub(cur, 1, 7) == 'reseed:' then return {1, cur} end
local meta = redis.call('GET', KEYS[3])
if meta and meta ~= ARGV[5] then return {3, meta} end
redis.call('SET', KEYS[3], ARGV[5])
redis.call('SET', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'id', '0-1', 'trimmed', '0-1', 'data', ARGV[3], 'seen', ARGV[4], 'rollouts', ARGV[6])
return {2, ARGV[2]}
";

/// Where a re-seeded stream's snapshot stands: before every entry (`XADD *` ids are
/// milliseconds), after a new instance's cursor (`0-0`), so that one loads it.
pub(super) const RESEED_ID: StreamId = StreamId(0, 1);

/// Reads up to `ARGV[3]` entries after `ARGV[2]`, unless the epoch is no longer `ARGV[1]`
/// (then nil): an instance never reads the entries of a stream that replaced the one it knew
/// before it has recovered.
pub(super) const PULL_SCRIPT: &str = r"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return false end
return redis.call('XRANGE', KEYS[1], ARGV[2], '+', 'COUNT', ARGV[3])
";

/// A shared state that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error("state.namespace `{namespace}`: Redis holds the state of another configuration ({reason}). Fix: use another state.namespace, or start one instance with `equiroute serve --reset-state` to delete the shared state")]
    Mismatch { namespace: String, reason: String },
    #[error("Redis state backend: {0}")]
    Redis(String),
    /// Redis refused the user name and password: a gateway does not start so (a wrong
    /// password does not mend itself, unlike an outage).
    #[error("Redis state backend: Redis refused the credentials ({0}). Fix: check state.username and the password (the variable state.password_env names, or the user information of the URL)")]
    Auth(String),
    /// `--reset-state` while instances of the namespace run: they would write their
    /// learning back within a sync.
    #[error("state.namespace `{namespace}`: {count} instance(s) of this namespace are running and would write their learning back into Redis at their next sync, so nothing was deleted. Fix: stop every instance of the namespace, then start one with `--reset-state`; an instance stopped without a clean exit counts as running for {forgotten_s} s after its last sync")]
    Live {
        namespace: String,
        count: usize,
        forgotten_s: u64,
    },
}

/// A stream entry id, `ms-seq`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct StreamId(pub u64, pub u64);

impl StreamId {
    pub(super) fn parse(s: &str) -> Option<StreamId> {
        let (ms, seq) = s.split_once('-')?;
        Some(StreamId(ms.parse().ok()?, seq.parse().ok()?))
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// Key names, all with one hash tag so that a Redis Cluster keeps them on one node.
#[derive(Debug)]
pub(super) struct Keys {
    pub(super) log: String,
    pub(super) acks: String,
    pub(super) snapshot: String,
    pub(super) meta: String,
    pub(super) epoch: String,
    /// The promoted rollouts' policies by interface (a hash), so that instances configured
    /// with a promoted policy recognise the namespace
    /// ([`Syncer::follows_promotions`](super::Syncer::follows_promotions)).
    pub(super) promoted: String,
    /// Prefix of the feedback claims (`{ns}:fb:` and the request id).
    pub(super) claims: String,
    /// Prefix of the providers' capacity counts (`{ns}:cap:`, interface and provider).
    pub(super) quotas: String,
    /// The live instances (a sorted set: instance id, until when in Redis's milliseconds).
    pub(super) live: String,
}

impl Keys {
    pub(super) fn new(ns: &str) -> Keys {
        Keys {
            log: format!("{{{ns}}}:log"),
            acks: format!("{{{ns}}}:acks"),
            snapshot: format!("{{{ns}}}:snapshot"),
            meta: format!("{{{ns}}}:meta"),
            epoch: format!("{{{ns}}}:epoch"),
            promoted: format!("{{{ns}}}:promoted"),
            claims: format!("{{{ns}}}:fb:"),
            quotas: format!("{{{ns}}}:cap:"),
            live: format!("{{{ns}}}:live"),
        }
    }
}

pub(super) fn redis_err(e: &dyn std::fmt::Display) -> SharedError {
    SharedError::Redis(e.to_string())
}

/// A command's error: [`SharedError::Auth`] when Redis refused the credentials (or wants
/// some), else [`SharedError::Redis`]. Redis's messages never repeat the password.
fn command_err(e: &redis::RedisError) -> SharedError {
    let refused = e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("WRONGPASS" | "NOAUTH"));
    if refused {
        SharedError::Auth(e.to_string())
    } else {
        redis_err(e)
    }
}

pub(super) async fn timed<T>(
    f: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> Result<T, SharedError> {
    match tokio::time::timeout(COMMAND_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(command_err(&e)),
        Err(_) => Err(SharedError::Redis(format!(
            "no answer within {} s",
            COMMAND_TIMEOUT.as_secs()
        ))),
    }
}

/// The client of `cfg`'s URL, with its user, password and CA file (the error never shows
/// the URL: it may hold a password).
pub(super) fn client(cfg: &RedisStateConfig) -> Result<redis::Client, SharedError> {
    use redis::IntoConnectionInfo;
    let invalid =
        || SharedError::Redis("state.url is not a valid redis:// or rediss:// URL".into());
    let info = cfg
        .url
        .0
        .as_str()
        .into_connection_info()
        .map_err(|_| invalid())?;
    let mut settings = info.redis_settings().clone();
    if let Some(user) = &cfg.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &cfg.password {
        settings = settings.set_password(&password.0);
    }
    let info = info.set_redis_settings(settings);
    match &cfg.tls_ca_file {
        None => redis::Client::open(info).map_err(|_| invalid()),
        Some(path) => {
            let root_cert = crate::config::tls::read_ca(path)
                .map_err(|fix| SharedError::Redis(format!("state.tls_ca_file: {fix}")))?;
            let certificates = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(root_cert),
            };
            redis::Client::build_with_tls(info, certificates).map_err(|e| redis_err(&e))
        }
    }
}

/// Deletes every key of the namespace (for `serve --reset-state`), unless an instance of
/// it is live: a running instance holds the learning in memory and would write it back at
/// its next sync, so the reset would do nothing.
///
/// # Errors
/// [`SharedError::Live`] while an instance syncs with the namespace (nothing is deleted);
/// Redis is unreachable.
pub async fn reset(cfg: &RedisStateConfig) -> Result<(), SharedError> {
    let mut conn = timed(client(cfg)?.get_multiplexed_async_connection()).await?;
    let keys = Keys::new(&cfg.namespace);
    let live: Vec<String> = timed(
        redis::Script::new(RESET_SCRIPT)
            .key(&keys.live)
            .key(&keys.log)
            .key(&keys.acks)
            .key(&keys.snapshot)
            .key(&keys.meta)
            .key(&keys.epoch)
            .key(&keys.promoted)
            .invoke_async(&mut conn),
    )
    .await?;
    if live.is_empty() {
        return Ok(());
    }
    Err(SharedError::Live {
        namespace: cfg.namespace.clone(),
        count: live.len(),
        forgotten_s: live_for(cfg.sync_interval).as_secs(),
    })
}
