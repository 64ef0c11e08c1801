"""Tenant limits: concurrent requests, requests per minute and tokens per
minute, each a part of the tenant's contract (gateway/tenancy.py).

`TenantLimiter` is the seam. `InMemoryTenantLimiter` keeps the counters in
this process: the single-gateway default. `gateway/tenant_limits_redis.py`
keeps them in Redis so that they hold across gateway replicas, and
`make_tenant_limiter` picks one from the config. Rates are token buckets
refilled continuously, `capacity` units per minute.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

from gateway.errors import RateLimited
from gateway.tenancy import Tenant, TenantLimits

# Tenant states are swept for idle ones once there are this many, then
# whenever their number doubles since the last sweep.
_MIN_SWEEP_AT = 1024
# A tenant at its concurrency limit retries after this long: nothing tells
# when one of its requests ends.
CONCURRENCY_RETRY_S = 1.0
RATE_PERIOD_S = 60.0


@dataclass(frozen=True)
class LimiterHealth:
    """What /health and /metrics say about the limiter. `shared`: limits
    hold across replicas (a shared store, reachable now); `backend` names
    where the counters live."""

    backend: str
    shared: bool
    up: bool = True
    detail: str = ""


class TenantHold(abc.ABC):
    """One admitted request's share of its tenant's limits."""

    @abc.abstractmethod
    def release(self, unused_tokens: int) -> None:
        """Give back the concurrency slot and `unused_tokens` of the
        tokens-per-minute reservation. Called once, on the event loop; never
        blocks (an implementation that needs I/O schedules it)."""


class TenantLimiter(abc.ABC):
    """Decides whether a tenant may start one more request.

    Contract: `check` and `acquire` are coroutines awaited on the event loop
    and must never block it. Both raise `RateLimited` naming the limit hit
    (`max_concurrent`, `requests_per_minute`, `tokens_per_minute`) with a
    retry delay, and may raise `ServiceUnavailable` when the limits cannot
    be judged at all. `check` takes nothing; `acquire` atomically checks and
    takes one request, `tokens` tokens and a concurrency slot, returned as a
    hold whose `release` gives them back (`settle` waits for releases still
on their way). A bucket over its capacity is
    never refused forever: a cost above the capacity fits once it is full.
    A tenant's changed limits apply from its next request (its buckets
    start full again). `start`/`stop` bracket the app's life; `stop` waits
    for scheduled releases."""

    @abc.abstractmethod
    async def check(self, tenant: Tenant, tokens: int) -> None: ...

    @abc.abstractmethod
    async def acquire(self, tenant: Tenant, tokens: int) -> TenantHold: ...

    @abc.abstractmethod
    def health(self) -> LimiterHealth: ...

    async def start(self) -> None:
        pass

    async def settle(self) -> None:
        """Wait until every release made so far has taken effect."""

    async def stop(self) -> None:
        pass


class TokenBucket:
    """`capacity` units, refilled at `capacity` per `period_s`."""

    def __init__(self, capacity: int, period_s: float, now: float):
        self.capacity = capacity
        self.period_s = period_s
        self.rate = capacity / period_s
        self.level = float(capacity)
        self.stamp = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_time(self, cost: int, now: float) -> float:
        """Seconds until `cost` units fit; 0 if they fit now. A cost above the
        capacity fits once the bucket is full (it then runs into debt), so an
        oversized request is delayed, never refused forever."""
        self._refill(now)
        need = min(cost, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, cost: int, now: float) -> None:
        self._refill(now)
        self.level -= cost

    def give_back(self, amount: int, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.level >= self.capacity

    def resized(self, capacity: int, now: float) -> TokenBucket:
        """This bucket under a new capacity, keeping what was used in the
        last period: changing a tenant's limits must not hand it a fresh
        minute's worth on top of what it just spent."""
        self._refill(now)
        bucket = TokenBucket(capacity, self.period_s, now)
        bucket.level = capacity - (self.capacity - self.level)
        return bucket


class _TenantState:
    def __init__(self):
        self.active = 0
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.limits_seen: tuple = ()

    def idle(self, now: float) -> bool:
        """No request in flight and every bucket full again: the same as a
        fresh state, so it can be forgotten."""
        return self.active == 0 and all(b is None or b.full(now) for b in (self.requests, self.tokens))


def _bucket(old: TokenBucket | None, capacity: int | None, now: float) -> TokenBucket | None:
    if capacity is None:
        return None
    return TokenBucket(capacity, RATE_PERIOD_S, now) if old is None else old.resized(capacity, now)


class _InMemoryHold(TenantHold):
    def __init__(self, limiter: InMemoryTenantLimiter, tenant_id: str):
        self._limiter, self._tenant_id = limiter, tenant_id

    def release(self, unused_tokens: int) -> None:
        self._limiter._release(self._tenant_id, unused_tokens)


def rate_limited(tenant: Tenant, limit: str, retry_after_s: float) -> RateLimited:
    """The 429 for a tenant limit, worded the same by every limiter."""
    limits = tenant.limits
    what = {"max_concurrent": f"at its limit of {limits.max_concurrent} concurrent requests",
            "requests_per_minute": f"over its limit of {limits.requests_per_minute} requests per minute",
            "tokens_per_minute": f"over its limit of {limits.tokens_per_minute} tokens per minute"}[limit]
    return RateLimited(f"tenant {tenant.name!r} is {what}", limit=limit, retry_after_s=retry_after_s)


class InMemoryTenantLimiter(TenantLimiter):
    """The limits in this process: they hold per gateway. Everything runs
    on the event loop, so there are no locks; time comes from `clock`."""

    def __init__(self, *, clock: Callable[[], float]):
        self._clock = clock
        # Keyed by tenant id; idle states are dropped (see `_sweep`), so
        # this holds about the tenants active in the last minute, deleted
        # tenants' included only until their buckets refill.
        self._tenants: dict[str, _TenantState] = {}
        self._sweep_at = _MIN_SWEEP_AT

    async def check(self, tenant: Tenant, tokens: int) -> None:
        self.check_now(tenant, tokens)

    async def acquire(self, tenant: Tenant, tokens: int) -> TenantHold:
        return self.acquire_now(tenant, tokens)

    def health(self) -> LimiterHealth:
        return LimiterHealth(backend="memory", shared=False)

    def check_now(self, tenant: Tenant, tokens: int) -> _TenantState:
        """`check` without the coroutine, for callers that cannot await."""
        now = self._clock()
        state = self._state(tenant, now)
        limits = tenant.limits
        if limits.max_concurrent is not None and state.active >= limits.max_concurrent:
            raise rate_limited(tenant, "max_concurrent", CONCURRENCY_RETRY_S)
        for bucket, cost, limit in ((state.requests, 1, "requests_per_minute"),
                                    (state.tokens, tokens, "tokens_per_minute")):
            wait = 0.0 if bucket is None else bucket.wait_time(cost, now)
            if wait > 0:
                raise rate_limited(tenant, limit, wait)
        return state

    def acquire_now(self, tenant: Tenant, tokens: int) -> TenantHold:
        state = self.check_now(tenant, tokens)
        now = self._clock()
        state.active += 1
        if state.requests is not None:
            state.requests.take(1, now)
        if state.tokens is not None:
            state.tokens.take(tokens, now)
        return _InMemoryHold(self, tenant.id)

    def _release(self, tenant_id: str, unused_tokens: int) -> None:
        state = self._tenants.get(tenant_id)
        if state is None:
            return
        state.active -= 1
        if unused_tokens > 0 and state.tokens is not None:
            state.tokens.give_back(unused_tokens, self._clock())

    def _state(self, tenant: Tenant, now: float) -> _TenantState:
        limits: TenantLimits = tenant.limits
        state = self._tenants.get(tenant.id)
        if state is None:
            if len(self._tenants) >= self._sweep_at:
                self._sweep(now)
            state = self._tenants[tenant.id] = _TenantState()
        seen = (limits.requests_per_minute, limits.tokens_per_minute)
        if seen != state.limits_seen:  # new tenant, or its limits were updated
            state.limits_seen = seen
            state.requests = _bucket(state.requests, seen[0], now)
            state.tokens = _bucket(state.tokens, seen[1], now)
        return state

    def _sweep(self, now: float) -> None:
        """Forget idle tenant states. Run when the map reaches `_sweep_at`,
        which then doubles the live states left: amortized O(1) per new
        tenant, and never more than about twice the non-idle states."""
        for tenant_id in [t for t, s in self._tenants.items() if s.idle(now)]:
            del self._tenants[tenant_id]
        self._sweep_at = max(_MIN_SWEEP_AT, 2 * len(self._tenants))

    def tracked_tenants(self) -> int:
        """Tenant states held, for tests and metrics."""
        return len(self._tenants)


def make_tenant_limiter(config, *, clock: Callable[[], float]) -> TenantLimiter:
    """The one place that chooses: Redis when `--redis-url` is set (the
    limits then hold across replicas), else this process's memory."""
    local = InMemoryTenantLimiter(clock=clock)
    if config.redis.url is None:
        return local
    from gateway.tenant_limits_redis import FailoverLimiter, RedisTenantLimiter

    return FailoverLimiter(RedisTenantLimiter.from_config(config.redis), local, mode=config.redis.failure_mode,
                           clock=clock)
