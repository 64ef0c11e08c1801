"""Tenant limits in Redis: two limiters on one Redis stand for two gateway
replicas, and must together admit exactly what one tenant's limits allow.
The outage tests take Redis "down" through a TCP proxy (the shared server
stays up)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from urllib.parse import urlsplit

import pytest

from gateway.config import RedisLimitsConfig
from gateway.errors import RateLimited, ServiceUnavailable
from gateway.tenancy import Tenant, TenantLimits, Tier
from gateway.tenant_limits import InMemoryTenantLimiter
from tests.gateway.fakes import ManualClock
from tests.gateway.tcp_proxy import TcpProxy

pytestmark = pytest.mark.anyio


def tenant(**limits) -> Tenant:
    return Tenant(id=uuid.uuid4().hex, name="acme", tier=Tier.STANDARD, limits=TenantLimits(**limits))


def limiter(url: str, *, lease_s: float = 900.0):
    from gateway.tenant_limits_redis import RedisTenantLimiter

    return RedisTenantLimiter.from_config(RedisLimitsConfig(url=url, lease_s=lease_s))


@pytest.fixture
async def replicas(redis_url):
    pair = limiter(redis_url), limiter(redis_url)
    yield pair
    for one in pair:
        await one.stop()


async def outcomes(calls) -> list:
    """Each call's hold or RateLimited, all started at once."""
    return await asyncio.gather(*calls, return_exceptions=True)


async def test_two_replicas_together_admit_exactly_the_requests_per_minute(replicas):
    acme = tenant(requests_per_minute=7)
    results = await outcomes(replicas[i % 2].acquire(acme, 1) for i in range(20))
    refused = [r for r in results if isinstance(r, RateLimited)]
    assert len(results) - len(refused) == 7
    assert {r.limit for r in refused} == {"requests_per_minute"}
    # One request in 60/7 s: about 9 s until the next fits.
    assert all(8 <= r.retry_after_s <= 9 for r in refused)
    for one in replicas:
        with pytest.raises(RateLimited):
            await one.check(acme, 1)


async def test_concurrency_is_counted_across_replicas_and_released_through_either(replicas):
    a, b = replicas
    acme = tenant(max_concurrent=2)
    held = [await a.acquire(acme, 1), await b.acquire(acme, 1)]
    for one in replicas:
        with pytest.raises(RateLimited) as info:
            await one.acquire(acme, 1)
        assert info.value.limit == "max_concurrent"
    held[0].release(0)
    held[0].release(0)  # a second release of one hold frees nothing more
    await a.settle()
    await b.acquire(acme, 1)
    with pytest.raises(RateLimited):
        await a.acquire(acme, 1)


async def test_tokens_per_minute_are_refunded_down_to_what_was_generated(replicas):
    a, b = replicas
    acme = tenant(tokens_per_minute=600)
    first = await a.acquire(acme, 500)  # prompt 100 + max_tokens 400
    with pytest.raises(RateLimited) as info:
        await b.acquire(acme, 200)  # 100 left
    assert info.value.limit == "tokens_per_minute" and info.value.retry_after_s == 10
    first.release(350)  # 50 of the 400 were generated
    await a.settle()
    await b.acquire(acme, 200)


async def test_changed_limits_apply_from_the_next_request(replicas):
    a, b = replicas
    acme = tenant(requests_per_minute=1)
    await a.acquire(acme, 1)
    with pytest.raises(RateLimited):
        await b.acquire(acme, 1)
    raised = Tenant(id=acme.id, name=acme.name, tier=acme.tier, limits=TenantLimits(requests_per_minute=100))
    await b.acquire(raised, 1)


def _with_limits(one: Tenant, **limits) -> Tenant:
    return Tenant(id=one.id, name=one.name, tier=one.tier, limits=TenantLimits(**limits))


async def _changing_limits_keeps_what_was_used(limiter) -> None:
    acme = tenant(requests_per_minute=5, tokens_per_minute=1000)
    for _ in range(4):
        await limiter.acquire(acme, 200)
    # 4 requests and 800 tokens used. Lowered to 3 a minute: already past it.
    with pytest.raises(RateLimited) as info:
        await limiter.acquire(_with_limits(acme, requests_per_minute=3, tokens_per_minute=1000), 1)
    assert info.value.limit == "requests_per_minute"
    # Raised to 6 and 1200: two more requests, not six; 400 more tokens, not 1200.
    raised = _with_limits(acme, requests_per_minute=6, tokens_per_minute=1200)
    with pytest.raises(RateLimited) as info:
        await limiter.acquire(raised, 500)
    assert info.value.limit == "tokens_per_minute"
    await limiter.acquire(raised, 200)
    await limiter.acquire(raised, 100)
    with pytest.raises(RateLimited) as info:
        await limiter.acquire(raised, 1)
    assert info.value.limit == "requests_per_minute"


async def test_changed_limits_keep_what_was_used_in_redis(replicas):
    await _changing_limits_keeps_what_was_used(replicas[0])


async def test_changed_limits_keep_what_was_used_in_memory():
    await _changing_limits_keeps_what_was_used(InMemoryTenantLimiter(clock=ManualClock()))


async def test_an_oversized_request_fits_a_full_bucket_and_leaves_debt(replicas):
    a, b = replicas
    acme = tenant(tokens_per_minute=100)
    await a.acquire(acme, 250)
    with pytest.raises(RateLimited) as info:
        await b.acquire(acme, 1)
    # 150 tokens of debt plus one: 151 at 100 a minute, about 91 s.
    assert info.value.retry_after_s == 91


async def test_keys_expire_so_idle_tenants_leave_nothing_behind(redis_url, replicas):
    import redis.asyncio as aioredis

    a, _ = replicas
    acme = tenant(max_concurrent=5, requests_per_minute=60, tokens_per_minute=6000)
    hold = await a.acquire(acme, 100)
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = sorted(k.decode() for k in await client.keys(f"loragw:limits:{{{acme.id}}}:*"))
        assert keys == [f"loragw:limits:{{{acme.id}}}:active", f"loragw:limits:{{{acme.id}}}:rate"]
        # The buckets are 1 request and 100 tokens down: full again in 1 s.
        assert 0 < await client.pttl(keys[1]) <= 1001
        assert 0 < await client.ttl(keys[0]) <= 901  # the lease
        hold.release(100)  # nothing generated: the tokens come back
        await a.settle()
        assert await client.exists(keys[0]) == 0
        assert 0 < await client.pttl(keys[1]) <= 1001  # the request itself stays spent
    finally:
        await client.aclose()


async def test_a_dead_replicas_hold_lapses_after_its_lease(redis_url):
    short = limiter(redis_url, lease_s=0.2)
    try:
        acme = tenant(max_concurrent=1)
        await short.acquire(acme, 1)  # never released: its replica "died"
        with pytest.raises(RateLimited):
            await short.acquire(acme, 1)
        await asyncio.sleep(0.3)
        await short.acquire(acme, 1)
    finally:
        await short.stop()


# ---- Redis unreachable ----


@pytest.fixture
def proxy(redis_url):
    parts = urlsplit(redis_url)
    proxy = TcpProxy(parts.hostname, parts.port or 6379)
    proxy.up()
    proxy.url = f"redis://127.0.0.1:{proxy.port}{parts.path}"
    yield proxy
    proxy.close()


def failover(url: str, mode: str, clock):
    from gateway.tenant_limits_redis import FailoverLimiter

    return FailoverLimiter(limiter(url), InMemoryTenantLimiter(clock=clock), mode=mode, clock=clock)


async def test_local_mode_judges_by_this_gateways_limits_and_recovers(proxy, caplog):
    from gateway.tenant_limits_redis import PROBE_EVERY_S

    clock = ManualClock()
    limits = failover(proxy.url, "local", clock)
    acme = tenant(requests_per_minute=2)
    try:
        await limits.acquire(acme, 1)  # in Redis
        proxy.down()
        with caplog.at_level(logging.WARNING, logger="gateway.tenant_limits_redis"):
            await limits.acquire(acme, 1)  # local: a fresh bucket of 2
            await limits.acquire(acme, 1)
            with pytest.raises(RateLimited):
                await limits.acquire(acme, 1)
        assert not limits.health().up and "local" in limits.health().detail
        assert [r.message for r in caplog.records if "unreachable" in r.message] and len(caplog.records) == 1
        proxy.up()
        with pytest.raises(RateLimited):  # not probed yet: still local
            await limits.acquire(acme, 1)
        clock.now += PROBE_EVERY_S
        await limits.acquire(acme, 1)  # Redis again: its bucket had one request left
        assert limits.health().up and "reachable again" in caplog.records[-1].message
        with pytest.raises(RateLimited):
            await limits.acquire(acme, 1)
    finally:
        await limits.stop()


async def test_refuse_mode_answers_503_until_redis_is_back(proxy):
    clock = ManualClock()
    limits = failover(proxy.url, "refuse", clock)
    acme = tenant()
    try:
        proxy.down()
        for _ in range(2):  # the first waits on Redis, the second knows it is down
            with pytest.raises(ServiceUnavailable) as info:
                await limits.check(acme, 1)
            assert info.value.code == "rate_limiter_unavailable" and info.value.headers["Retry-After"] == "2"
        proxy.up()
        clock.now += 10
        hold = await limits.acquire(acme, 1)
        hold.release(0)
        await limits.settle()
        assert limits.health().up
    finally:
        await limits.stop()


async def test_a_release_while_redis_is_down_is_logged_and_left_to_its_lease(proxy, caplog):
    limits = failover(proxy.url, "local", ManualClock())
    try:
        hold = await limits.acquire(tenant(max_concurrent=1), 1)
        proxy.down()
        with caplog.at_level(logging.WARNING, logger="gateway.tenant_limits_redis"):
            hold.release(0)
            await limits.settle()
        assert "lapses after its lease" in caplog.records[-1].message
    finally:
        await limits.stop()
