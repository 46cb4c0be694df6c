//! Providers' capacity counted in Redis, so that every instance using a provider's key stays
//! within its one limit together (see `server::capacity`): per provider a hash of requests
//! (`r:SECOND`) and tokens (`t:SECOND`) per second of Redis's clock, and the count its
//! rate-limit headers last said is left (`…:left`, expiring at their reset), counted down by
//! every request an instance sends. Taking a request is one Lua script, atomic across
//! instances; spending tokens and announcing a count are sent without waiting. Each waits at
//! most `claim_timeout_ms`, on the feedback claims' connection.

use super::handle::SharedHandle;
use crate::upstream::limits::Limit;
use equiroute_core::Millis;

/// Checks the windows and the announced count, and counts the request when they admit it.
/// `KEYS[1]` the hash, `KEYS[2]` the announced count; `ARGV[1]` the `rpm` (0: none),
/// `ARGV[2]` the `tpm` (0: none). Returns `{0, 0}` when taken, else `{limit, wait_ms}` with
/// limit 1 (`rpm`), 2 (`tpm`) or 3 (announced). A second counts until second + 60 is over.
const TAKE_SCRIPT: &str = r"
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local now_ms = now_s * 1000 + math.floor(tonumber(t[2]) / 1000)
local fields = redis.call('HGETALL', KEYS[1])
local sums = { r = 0, t = 0 }
local oldest = {}
local stale = {}
for i = 1, #fields, 2 do
  local kind = string.sub(fields[i], 1, 1)
  local s = tonumber(string.sub(fields[i], 3))
  if s == nil or s + 60 < now_s then
    stale[#stale + 1] = fields[i]
  else
    sums[kind] = (sums[kind] or 0) + tonumber(fields[i + 1])
    if oldest[kind] == nil or s < oldest[kind] then oldest[kind] = s end
  end
end
if #stale > 0 then redis.call('HDEL', KEYS[1], unpack(stale)) end
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
if rpm > 0 and sums.r >= rpm then return { 1, (oldest.r + 61) * 1000 - now_ms } end
if tpm > 0 and sums.t >= tpm then return { 2, (oldest.t + 61) * 1000 - now_ms } end
local left = redis.call('GET', KEYS[2])
if left then
  if tonumber(left) <= 0 then return { 3, redis.call('PTTL', KEYS[2]) } end
  redis.call('DECR', KEYS[2])
end
redis.call('HINCRBY', KEYS[1], 'r:' .. now_s, 1)
redis.call('PEXPIRE', KEYS[1], 62000)
return { 0, 0 }
";

/// Adds `ARGV[1]` tokens to this second of `KEYS[1]`.
const SPEND_SCRIPT: &str = r"
local now_s = tonumber(redis.call('TIME')[1])
redis.call('HINCRBY', KEYS[1], 't:' .. now_s, tonumber(ARGV[1]))
redis.call('PEXPIRE', KEYS[1], 62000)
return 1
";

static TAKE: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(TAKE_SCRIPT));
static SPEND: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(SPEND_SCRIPT));

/// What the shared counts said of a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SharedTake {
    /// Admitted and counted.
    Taken,
    /// The limit is used up, for about this long.
    Refused(Limit, Option<Millis>),
    /// Redis did not answer in time (or is not connected): the instance counts alone.
    Unavailable,
}

impl SharedHandle {
    /// The key of `provider`'s counts on `interface`.
    #[must_use]
    pub fn quota_key(&self, interface: &str, provider: &str) -> String {
        format!("{}{interface}:{provider}", self.quotas)
    }

    /// Takes one request of the provider whose counts are at `key`.
    pub async fn take_quota(&self, key: &str, rpm: u64, tpm: u64) -> SharedTake {
        let Some(mut conn) = self.claims.connection() else {
            return SharedTake::Unavailable;
        };
        let mut call = TAKE.key(key);
        call.key(format!("{key}:left")).arg(rpm).arg(tpm);
        match tokio::time::timeout(
            self.claims.timeout(),
            call.invoke_async::<(i64, i64)>(&mut conn),
        )
        .await
        {
            Ok(Ok((0, _))) => SharedTake::Taken,
            Ok(Ok((code, wait))) => {
                let limit = match code {
                    1 => Limit::Requests,
                    2 => Limit::Tokens,
                    _ => Limit::Announced,
                };
                SharedTake::Refused(limit, (wait > 0).then_some(Millis(wait as f64)))
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "the shared capacity count failed: counting alone");
                SharedTake::Unavailable
            }
            Err(_) => SharedTake::Unavailable,
        }
    }

    /// Adds the tokens an answer used to the provider's counts, without waiting.
    pub fn spend_quota(&self, key: String, tokens: u64) {
        let Some(mut conn) = self.claims.connection() else {
            return;
        };
        let timeout = self.claims.timeout();
        tokio::spawn(async move {
            let mut call = SPEND.key(&key);
            call.arg(tokens);
            let _ = tokio::time::timeout(timeout, call.invoke_async::<i64>(&mut conn)).await;
        });
    }

    /// Sets the count the provider's headers said is left (less the requests this instance
    /// has in flight), until their reset, without waiting.
    pub fn announce_quota(&self, key: &str, remaining: u64, reset: Millis) {
        let Some(mut conn) = self.claims.connection() else {
            return;
        };
        let timeout = self.claims.timeout();
        let mut set = redis::cmd("SET");
        set.arg(format!("{key}:left"))
            .arg(remaining)
            .arg("PX")
            .arg(reset.0.ceil().max(1.0) as u64);
        tokio::spawn(async move {
            let _ = tokio::time::timeout(timeout, set.query_async::<()>(&mut conn)).await;
        });
    }
}
