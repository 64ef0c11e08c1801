"""Tenant limits in Redis, shared by every gateway replica that points at it
(`loragw serve --redis-url`), and the fail-safe for when Redis is gone.

Each tenant has two keys, hash-tagged by tenant id so they share a slot:

- `loragw:limits:{<tenant id>}:rate`, a hash with the requests-per-minute
  and tokens-per-minute buckets (level, capacity seen, refill stamp). It
  expires when both buckets would be full again, since a missing bucket
  reads as full: an idle tenant leaves nothing behind.
- `loragw:limits:{<tenant id>}:active`, a sorted set of the tenant's
  requests in flight, scored by the end of their lease. Its size is the
  concurrency count; a replica that dies mid-request cannot release its
  holds, so they lapse after `--redis-lease` instead of blocking the
  tenant forever.

The scripts read the time with Redis's TIME, never a gateway's clock, so
replicas whose clocks disagree still agree on every bucket. Each runs
atomically, so two replicas can never both take the last token.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.errors import ServiceUnavailable
from gateway.tenancy import Tenant
from gateway.tenant_limits import (CONCURRENCY_RETRY_S, InMemoryTenantLimiter, LimiterHealth, TenantHold,
                                   TenantLimiter, rate_limited)

log = logging.getLogger(__name__)

KEY_PREFIX = "loragw:limits:"
FAILURE_MODES = ("local", "refuse")
# While Redis is down, one request in this long tries it again; the others
# go straight to the failure mode instead of each waiting on a timeout.
PROBE_EVERY_S = 1.0
UNAVAILABLE_RETRY_S = 2

# Shared by both scripts: the time, and the two buckets read and written.
# A bucket's level is refilled to `now` on read, at the capacity it was
# filled at; under another capacity (the tenant's limits changed) it keeps
# what was used, as the in-memory TokenBucket.resized does.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local f = redis.call('HMGET', KEYS[1], 'req', 'req_cap', 'req_at', 'tok', 'tok_cap', 'tok_at')
local function level(value, cap_seen, at, cap)
  if cap < 0 then return nil end
  if not (tonumber(value) and tonumber(cap_seen) and tonumber(at)) then return cap end
  local seen = tonumber(cap_seen)
  return cap - (seen - math.min(seen, tonumber(value) + (now - tonumber(at)) * seen / 60))
end
local req = level(f[1], f[2], f[3], rpm)
local tok = level(f[4], f[5], f[6], tpm)
local function store()
  local args, full_ms = {}, 0
  for _, b in ipairs({{'req', req, rpm}, {'tok', tok, tpm}}) do
    if b[2] and b[3] > 0 and b[2] < b[3] then
      table.insert(args, b[1]); table.insert(args, b[2])
      table.insert(args, b[1] .. '_cap'); table.insert(args, b[3])
      table.insert(args, b[1] .. '_at'); table.insert(args, now)
      full_ms = math.max(full_ms, (b[3] - b[2]) * 60000 / b[3])
    end
  end
  redis.call('DEL', KEYS[1])
  if #args > 0 then
    redis.call('HSET', KEYS[1], unpack(args))
    redis.call('PEXPIRE', KEYS[1], math.ceil(full_ms) + 1)
  end
end
"""

# KEYS: rate, active. ARGV: rpm, tpm (-1: none), max concurrent (-1: none),
# tokens, take (1) or only check (0), hold id, lease seconds.
# Returns {0} when admitted, else {1, limit, retry after in ms}.
_ACQUIRE = _PRELUDE + """
local max_c, cost, take = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5] == '1'
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if max_c >= 0 and redis.call('ZCARD', KEYS[2]) >= max_c then
  return {1, 'max_concurrent', 0}
end
local function wait_ms(have, need, cap)
  if cap <= 0 then return 60000 end
  return math.ceil((need - have) * 60000 / cap)
end
if req and req < 1 then return {1, 'requests_per_minute', wait_ms(req, 1, rpm)} end
if tok and tok < math.min(cost, tpm) then return {1, 'tokens_per_minute', wait_ms(tok, math.min(cost, tpm), tpm)} end
if not take then return {0} end
local lease = tonumber(ARGV[7])
redis.call('ZADD', KEYS[2], now + lease, ARGV[6])
redis.call('EXPIRE', KEYS[2], math.ceil(lease) + 1)
if req then req = req - 1 end
if tok then tok = tok - cost end
store()
return {0}
"""

# KEYS: rate, active. ARGV: rpm, tpm, hold id, unused tokens. Once per
# hold: a second release, or one after the lease lapsed, changes nothing.
_RELEASE = _PRELUDE + """
if redis.call('ZREM', KEYS[2], ARGV[3]) == 0 then return 0 end
if tok then tok = math.min(tpm, tok + tonumber(ARGV[4])) end
store()
return 1
"""


class LimiterUnavailable(Exception):
    """The shared store did not answer; the limits cannot be judged there."""


def _limit_args(tenant: Tenant) -> tuple[int, int, int]:
    limits = tenant.limits
    return tuple(-1 if v is None else v
                 for v in (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent))


class _RedisHold(TenantHold):
    def __init__(self, limiter: RedisTenantLimiter, tenant: Tenant, hold_id: str):
        self._limiter, self._tenant, self._hold_id = limiter, tenant, hold_id

    def release(self, unused_tokens: int) -> None:
        self._limiter.release_soon(self._tenant, self._hold_id, unused_tokens)


class RedisTenantLimiter(TenantLimiter):
    """The limits in Redis. Raises `LimiterUnavailable` when Redis does not
    answer; `FailoverLimiter` decides what that means."""

    def __init__(self, client: aioredis.Redis, *, lease_s: float, prefix: str = KEY_PREFIX):
        self._client = client
        self._lease_s = lease_s
        self._prefix = prefix
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        # Releases run as tasks (a request's end cannot await); kept here so
        # they are not collected early and `stop` can wait for them.
        self._pending: set[asyncio.Task] = set()

    @classmethod
    def from_config(cls, config) -> RedisTenantLimiter:
        # One retry, at once: a pooled connection that Redis closed while it
        # restarted fails the first try. More would only delay the fallback.
        client = aioredis.Redis.from_url(config.url, socket_timeout=config.timeout_s,
                                         socket_connect_timeout=config.timeout_s, retry=Retry(NoBackoff(), 1))
        return cls(client, lease_s=config.lease_s)

    def _keys(self, tenant_id: str) -> list[str]:
        base = f"{self._prefix}{{{tenant_id}}}"
        return [f"{base}:rate", f"{base}:active"]

    async def _run(self, script, keys, args):
        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            raise LimiterUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def _judge(self, tenant: Tenant, tokens: int, hold_id: str | None) -> None:
        rpm, tpm, max_c = _limit_args(tenant)
        args = [rpm, tpm, max_c, tokens, 0 if hold_id is None else 1, hold_id or "", self._lease_s]
        result = await self._run(self._acquire, self._keys(tenant.id), args)
        if int(result[0]) == 1:
            limit = result[1].decode() if isinstance(result[1], bytes) else result[1]
            retry_s = CONCURRENCY_RETRY_S if limit == "max_concurrent" else int(result[2]) / 1000
            raise rate_limited(tenant, limit, retry_s)

    async def check(self, tenant: Tenant, tokens: int) -> None:
        await self._judge(tenant, tokens, None)

    async def acquire(self, tenant: Tenant, tokens: int) -> TenantHold:
        hold = _RedisHold(self, tenant, uuid.uuid4().hex)
        # Shielded: a caller cancelled while the script runs (its client
        # left) must not leave a hold in Redis that nobody releases.
        call = asyncio.ensure_future(self._judge(tenant, tokens, hold._hold_id))
        try:
            await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: done.cancelled() or done.exception() or hold.release(0))
            raise
        return hold

    def release_soon(self, tenant: Tenant, hold_id: str, unused_tokens: int) -> None:
        rpm, tpm, _ = _limit_args(tenant)
        task = asyncio.ensure_future(self._release_one(self._keys(tenant.id), [rpm, tpm, hold_id, unused_tokens]))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _release_one(self, keys: list[str], args: list) -> None:
        try:
            await self._run(self._release, keys, args)
        except LimiterUnavailable as exc:
            # The lease lapses on its own; the unused tokens stay spent.
            log.warning("could not release a tenant hold in Redis (%s); it lapses after its lease", exc)

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except (RedisError, OSError) as exc:
            raise LimiterUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def health(self) -> LimiterHealth:
        return LimiterHealth(backend="redis", shared=True)

    async def settle(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def stop(self) -> None:
        await self.settle()
        await self._client.aclose()


class FailoverLimiter(TenantLimiter):
    """Redis while it answers; when it does not, `mode` decides: `local`
    judges by this gateway's in-memory limits (they then hold per replica,
    not across replicas), `refuse` answers 503. Each change is logged once;
    while down, Redis is tried again every `PROBE_EVERY_S`."""

    def __init__(self, shared: RedisTenantLimiter, local: InMemoryTenantLimiter, *, mode: str,
                 clock: Callable[[], float]):
        if mode not in FAILURE_MODES:
            raise ValueError(f"failure mode must be one of {FAILURE_MODES}, not {mode!r}")
        self.shared, self.local, self.mode = shared, local, mode
        self._clock = clock
        self.up = True
        self._next_probe = 0.0
        self._last_error = ""

    async def _call(self, method: str, tenant: Tenant, tokens: int):
        if self.up or self._clock() >= self._next_probe:
            try:
                result = await getattr(self.shared, method)(tenant, tokens)
            except LimiterUnavailable as exc:
                self._went_down(str(exc))
            else:
                self._came_back()
                return result
        if self.mode == "refuse":
            raise ServiceUnavailable("tenant limits cannot be checked (the rate-limit store is unreachable); "
                                     "retry later", code="rate_limiter_unavailable",
                                     headers={"Retry-After": str(UNAVAILABLE_RETRY_S)})
        return await getattr(self.local, method)(tenant, tokens)

    def _went_down(self, error: str) -> None:
        self._next_probe = self._clock() + PROBE_EVERY_S
        self._last_error = error
        if self.up:
            self.up = False
            consequence = ("tenant limits now hold per gateway, not across replicas" if self.mode == "local"
                           else "requests are refused with 503 until it is back")
            log.warning("Redis is unreachable (%s): %s", error, consequence)

    def _came_back(self) -> None:
        if not self.up:
            self.up = True
            log.warning("Redis is reachable again: tenant limits hold across replicas")

    async def check(self, tenant: Tenant, tokens: int) -> None:
        await self._call("check", tenant, tokens)

    async def acquire(self, tenant: Tenant, tokens: int) -> TenantHold:
        return await self._call("acquire", tenant, tokens)

    def health(self) -> LimiterHealth:
        if self.up:
            return LimiterHealth(backend="redis", shared=True)
        return LimiterHealth(backend="redis", shared=False, up=False,
                             detail=f"Redis unreachable ({self._last_error}); failure mode {self.mode}")

    async def start(self) -> None:
        try:
            await self.shared.ping()
        except LimiterUnavailable as exc:
            self._went_down(str(exc))

    async def settle(self) -> None:
        await self.shared.settle()

    async def stop(self) -> None:
        await self.shared.stop()
