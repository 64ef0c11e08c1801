"""The auth cache on a real store (SQLite and PostgreSQL), with an injected
clock: freshness within the TTL, exact key expiry, the stale window while
the database is down, and its size bound under a flood of keys."""

from __future__ import annotations

import datetime as dt

import pytest

from gateway import keys
from gateway.auth_cache import AuthCache
from gateway.store.base import NotFound, StoreUnavailable
from gateway.store.sql import SqlStore
from gateway.tenancy import TenantLimits, Tier
from tests.gateway.fakes import ManualClock

pytestmark = pytest.mark.anyio

TTL_S, STALE_S = 5.0, 60.0
NOW = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


class CountingStore:
    """The real store, counting the lookups the cache makes, and able to
    fail them as a database outage does."""

    def __init__(self, store: SqlStore):
        self.inner = store
        self.lookups = 0
        self.down = False

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if name not in ("authenticate", "get_adapter_grant", "list_adapter_grants"):
            return method

        async def lookup(*args, **kwargs):
            self.lookups += 1
            if self.down:
                raise StoreUnavailable("the database is unavailable (test)")
            return await method(*args, **kwargs)

        return lookup


@pytest.fixture
async def env(db_url):
    store = SqlStore.from_url(db_url)
    counting = CountingStore(store)
    clock = ManualClock()
    cache = AuthCache(counting, ttl_s=TTL_S, stale_s=STALE_S, max_entries=8, clock=clock)
    await store.create_tenant("acme", Tier.STANDARD, TenantLimits(requests_per_minute=10))
    key = await store.create_key("acme", now=NOW)
    await store.grant_adapter("acme-lora", owner="acme", shared=False)
    try:
        yield store, counting, clock, cache, key
    finally:
        await store.close()


async def test_db_hot_path_auth_is_answered_from_memory_within_the_ttl(env):
    store, counting, clock, cache, key = env
    first = await cache.authenticate(key.secret, now=NOW)
    assert first is not None and first.tenant.name == "acme"
    clock.now += TTL_S - 0.01
    assert await cache.authenticate(key.secret, now=NOW) == first
    assert counting.lookups == 1
    clock.now += 0.02
    assert await cache.authenticate(key.secret, now=NOW) == first
    assert counting.lookups == 2


async def test_db_hot_path_revocation_deletion_and_limit_changes_take_effect_within_the_ttl(env):
    store, counting, clock, cache, key = env
    assert await cache.authenticate(key.secret, now=NOW) is not None
    await store.revoke_key(key.info.id, now=NOW)
    assert await cache.authenticate(key.secret, now=NOW) is not None  # within the stated bound
    clock.now += TTL_S
    assert await cache.authenticate(key.secret, now=NOW) is None

    other = await store.create_key("acme", now=NOW)
    assert (await cache.authenticate(other.secret, now=NOW)).tenant.limits.requests_per_minute == 10
    await store.update_tenant("acme", tier=Tier.PREMIUM, limits=TenantLimits(requests_per_minute=1))
    clock.now += TTL_S
    changed = await cache.authenticate(other.secret, now=NOW)
    assert (changed.tenant.tier, changed.tenant.limits.requests_per_minute) == (Tier.PREMIUM, 1)
    await store.delete_tenant("acme")
    clock.now += TTL_S
    assert await cache.authenticate(other.secret, now=NOW) is None


async def test_db_hot_path_cached_key_never_outlives_its_expiry(env):
    store, counting, clock, cache, _key = env
    expires = NOW + dt.timedelta(seconds=2)
    key = await store.create_key("acme", expires_at=expires, now=NOW)
    assert await cache.authenticate(key.secret, now=NOW) is not None
    assert await cache.authenticate(key.secret, now=expires) is None  # same TTL window, past expiry


async def test_db_outage_recent_keys_and_grants_serve_from_the_stale_window_unseen_ones_raise(env):
    store, counting, clock, cache, key = env
    principal = await cache.authenticate(key.secret, now=NOW)
    grant = await cache.adapter_grant("acme-lora")
    visible = await cache.visible_grants("acme")
    unseen = await store.create_key("acme", now=NOW)
    counting.down = True
    clock.now += TTL_S + STALE_S - 0.01  # stale, but inside the window
    assert await cache.authenticate(key.secret, now=NOW) == principal
    assert await cache.adapter_grant("acme-lora") == grant
    assert await cache.visible_grants("acme") == visible == (grant,)
    with pytest.raises(StoreUnavailable):
        await cache.authenticate(unseen.secret, now=NOW)
    clock.now += 0.02
    with pytest.raises(StoreUnavailable):
        await cache.authenticate(key.secret, now=NOW)
    counting.down = False
    clock.now += cache.outage_recheck_s
    assert await cache.authenticate(unseen.secret, now=NOW) is not None


async def test_db_outage_lookups_fail_fast_for_a_moment_after_the_database_failed(env):
    store, counting, clock, cache, key = env
    principal = await cache.authenticate(key.secret, now=NOW)
    unseen = await store.create_key("acme", now=NOW)
    clock.now += TTL_S - 0.5
    counting.down, asked = True, counting.lookups
    with pytest.raises(StoreUnavailable):
        await cache.authenticate(unseen.secret, now=NOW)
    assert counting.lookups == asked + 1
    clock.now += 0.6  # stale now, and within the fail-fast second: served without asking, misses refused
    for _ in range(10):
        assert await cache.authenticate(key.secret, now=NOW) == principal
        with pytest.raises(StoreUnavailable):
            await cache.authenticate(unseen.secret, now=NOW)
    assert counting.lookups == asked + 1
    counting.down = False
    clock.now += cache.outage_recheck_s  # asked again, and back
    assert await cache.authenticate(unseen.secret, now=NOW) is not None
    assert counting.lookups == asked + 2


async def test_db_hot_path_misses_are_never_cached(env):
    store, counting, clock, cache, key = env
    for i in range(50):
        assert await cache.authenticate(f"lgw-random-{i}", now=NOW) is None
        with pytest.raises(NotFound):
            await cache.adapter_grant(f"no-such-adapter-{i}")
    assert len(cache) == 0
    # A key issued after a miss works at once.
    await store.grant_adapter("no-such-adapter-0", owner="acme", shared=False)
    assert (await cache.adapter_grant("no-such-adapter-0")).owner == "acme"


async def test_unbounded_caches_auth_cache_holds_at_most_max_entries_and_random_keys_evict_nothing(env):
    store, counting, clock, cache, key = env
    issued = [await store.create_key("acme", now=NOW) for _ in range(20)]
    for k in issued:
        assert await cache.authenticate(k.secret, now=NOW) is not None
    assert len(cache._principals) == 8
    # A flood of random keys leaves the recently used tenants' entries in place.
    for i in range(1000):
        assert await cache.authenticate(f"lgw-flood-{i}", now=NOW) is None
    counting.down = True
    for k in issued[-8:]:
        assert await cache.authenticate(k.secret, now=NOW) is not None
    assert len(cache._principals) == 8


async def test_db_hot_path_cache_is_keyed_by_the_key_hash_never_the_secret(env):
    store, counting, clock, cache, key = env
    await cache.authenticate(key.secret, now=NOW)
    held = list(cache._principals._entries)
    assert held == [keys.hash_secret(key.secret)] and key.secret not in held
