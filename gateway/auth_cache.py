"""What auth and model resolution read from the database, kept a few seconds.

Every /v1 request needs its caller's principal (API key -> tenant, tier,
limits) and, for an adapter, the adapter's grant. Asking the database each
time put it on every request's hot path, and made every request fail while
it was down. `AuthCache` answers from memory for `ttl_s` after the database
last did.

The bounds an operator can rely on:
- Freshness: an entry is reused for at most `ttl_s` (default 5 s) after the
  database answered. A revoked key, a deleted tenant, a tier or limit change
  and a changed grant are seen within `ttl_s` by every replica. A key's own
  expiry is exact: a cached principal is never used past it.
- Outage: when the database is unavailable (`StoreUnavailable`), an entry
  past `ttl_s` answers for up to `stale_s` more, so the tenants that were
  recently active keep working through a short outage; everyone else gets
  the 503. Nothing can be revoked while the database is down, so this only
  extends what the database last said.
- Failing fast: after a lookup found the database unavailable, for
  `outage_recheck_s` (1 s) lookups do not ask it again: stale entries answer
  at once and misses get `StoreUnavailable` at once, instead of each
  request waiting out a connect timeout against a silent database (and a
  database on its way back up is not met by the whole backlog at once).
- Size: each map is an LRU of `max_entries`. Only what the database
  confirmed is kept; an unknown key, tenant or adapter name is never
  cached. Caching misses would buy nothing against random keys (each one
  differs) and would let a flood of them evict live tenants' entries, and
  the next outage would then refuse everyone; it would also delay a newly
  issued key.
Principals are keyed by the key's sha256 (`keys.hash_secret`), never by the
secret itself. Everything runs on the event loop, so there are no locks;
time comes from the injected clock, so tests never sleep.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Awaitable, Callable, Generic, TypeVar

from gateway import keys
from gateway.lru import Lru
from gateway.store.base import NotFound, Store, StoreUnavailable
from gateway.tenancy import AdapterGrant, Principal

V = TypeVar("V")


@dataclass(frozen=True)
class _Entry(Generic[V]):
    value: V
    fetched_at: float  # the cache's clock when the database answered


class AuthCache:
    def __init__(self, store: Store, *, ttl_s: float, stale_s: float, max_entries: int,
                 clock: Callable[[], float], outage_recheck_s: float = 1.0):
        self.store = store
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self.outage_recheck_s = outage_recheck_s
        self._clock = clock
        self._unavailable_until = float("-inf")  # the clock's time to ask the database again
        self._principals: Lru[str, _Entry[Principal]] = Lru(max_entries)  # key hash -> principal
        self._grants: Lru[str, _Entry[AdapterGrant]] = Lru(max_entries)  # adapter name -> grant
        self._visible: Lru[str, _Entry[tuple[AdapterGrant, ...]]] = Lru(max_entries)  # tenant name -> its usable grants

    async def authenticate(self, secret: str, *, now: dt.datetime) -> Principal | None:
        """The principal for a live key, as `Store.authenticate`."""
        key_hash = keys.hash_secret(secret)
        principal = await self._through(self._principals, key_hash,
                                        lambda: self.store.authenticate(secret, now=now))
        if principal is not None and principal.key_expires_at is not None and principal.key_expires_at <= now:
            self._principals.pop(key_hash)
            return None
        return principal

    async def adapter_grant(self, name: str) -> AdapterGrant:
        """As `Store.get_adapter_grant`: NotFound for an ungranted name."""
        return await self._through(self._grants, name, lambda: self.store.get_adapter_grant(name))

    async def visible_grants(self, tenant: str) -> tuple[AdapterGrant, ...]:
        """The grants `tenant` may use: its own and the shared ones."""

        async def fetch() -> tuple[AdapterGrant, ...]:
            return tuple(await self.store.list_adapter_grants(visible_to=tenant))

        return await self._through(self._visible, tenant, fetch)

    def clear(self) -> None:
        """Forget everything (the next lookups go to the database)."""
        for lru in (self._principals, self._grants, self._visible):
            lru.clear()

    def __len__(self) -> int:
        return len(self._principals) + len(self._grants) + len(self._visible)

    async def _through(self, lru: Lru[str, _Entry[V]], key: str, fetch: Callable[[], Awaitable[V | None]]) -> V | None:
        """The cached value while fresh; else the database's answer, cached
        unless it is a miss; else, while the database is unavailable, the
        cached value for `stale_s` past its freshness."""
        now = self._clock()
        entry = lru.get(key)
        if entry is not None and now - entry.fetched_at < self.ttl_s:
            return entry.value
        usable_stale = entry is not None and now - entry.fetched_at < self.ttl_s + self.stale_s
        if now < self._unavailable_until:
            if usable_stale:
                return entry.value
            raise StoreUnavailable("the database is unavailable (it failed a moment ago)")
        try:
            value = await fetch()
        except StoreUnavailable:
            self._unavailable_until = self._clock() + self.outage_recheck_s
            if usable_stale:
                return entry.value
            raise
        except NotFound:
            lru.pop(key)
            raise
        if value is None:
            lru.pop(key)
        else:
            lru.put(key, _Entry(value, now))
        return value
