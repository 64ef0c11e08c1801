"""Billing's place in the gateway: the meter learns each request's tenant at
admission, and every ended request becomes ledger records via the spool.

`UsageObserver` is a `RequestObserver`. A request that finished (stop,
length) is settled at once: its last step's usage reached the meter before
its last output reached us. One that was aborted, errored or whose client
left may still be inside its engine's running step, so it is settled after that
engine completes its next step (or after `settle_timeout_s` with no step:
the engine is idle), and that step is billed to it too. With several
workers, it is the step of the worker that ran it that counts
(`EngineClient.step_mark`), not any worker's.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from typing import Callable

from adapters.errors import AdapterError
from billing.meter import PLATFORM_OVERHEAD, Account, Meter, MeteredUsage
from billing.records import (ADAPTER_LOAD, MAX_RECORD_ID, OVERHEAD, RECOMPUTE, REQUEST, UsageRecord,
                             seconds_to_us, to_us)
from billing.spool import Spool, SpoolFlusher
from gateway.lifecycle import RequestObserver, RequestRecord
from gateway.lru import Lru
from gateway.store.base import NotFound

log = logging.getLogger(__name__)

_SETTLED_AT_ONCE = ("stop", "length")
MAX_KNOWN_OWNERS = 4096


class AdapterOwners:
    """The tenants seen using adapter versions they own, by (name, version),
    in this process: the payer of a load whose version was deleted before
    its record was flushed, when the grant is gone or may name the owner of
    a later upload. A version's owner does not change (another owner means
    a new version), so forgetting the least recently used past
    `max_entries` loses only that fallback."""

    def __init__(self, max_entries: int = MAX_KNOWN_OWNERS):
        self._owners: Lru[tuple[str, int | None], Account] = Lru(max_entries)

    def saw(self, adapter: str, version: int, owner: Account) -> None:
        self._owners.put((adapter, version), owner)

    def get(self, adapter: str, version: int | None) -> Account | None:
        return self._owners.get((adapter, version))

    def __len__(self) -> int:
        return len(self._owners)


class UsageObserver(RequestObserver):
    def __init__(self, gw, meter: Meter, spool: Spool, flusher: SpoolFlusher, *, owners: AdapterOwners,
                 settle_timeout_s: float = 1.0, poll_s: float = 0.01):
        self.gw, self.meter, self.spool, self.flusher, self.owners = gw, meter, spool, flusher, owners
        self.settle_timeout_s, self.poll_s = settle_timeout_s, poll_s
        self._waiting: dict[str, RequestRecord] = {}  # ended, waiting for the engine's running step

    # ---- RequestObserver ----------------------------------------------------------

    def on_request_start(self, request_id: str, principal, adapter_key, adapter_owner) -> None:
        tenant = principal.tenant
        self.meter.register(request_id, _account(tenant, principal.key_id))
        if adapter_key is not None and adapter_owner == tenant.name:
            self.owners.saw(adapter_key[0], adapter_key[1], _account(tenant))

    def on_request_end(self, record: RequestRecord) -> None:
        if record.finish_reason in _SETTLED_AT_ONCE:
            self._settle(record)
            return
        self._waiting[record.request_id] = record
        loop = asyncio.get_running_loop()
        engine = self.gw.engine
        mark, deadline = engine.step_mark(record.request_id), loop.time() + self.settle_timeout_s

        def check() -> None:
            if record.request_id not in self._waiting:
                return  # settled by stop()
            if engine.stepped_since(mark) or loop.time() >= deadline:
                self._settle(self._waiting.pop(record.request_id))
            else:
                loop.call_later(self.poll_s, check)

        loop.call_later(self.poll_s, check)

    # ---- lifespan -------------------------------------------------------------------

    async def start(self) -> None:
        await self.flusher.start()

    async def stop(self) -> None:
        for request_id in list(self._waiting):
            self._settle(self._waiting.pop(request_id))
        self._spool(self._platform_records())
        await self.flusher.stop()
        self.spool.close()

    # ---- records ----------------------------------------------------------------------

    def _settle(self, record: RequestRecord) -> None:
        usage = self.meter.settle(record.request_id) or MeteredUsage(record.request_id, 0, 0, 0, ())
        records = [_request_record(record, usage)] + [
            UsageRecord(request_id=recompute_record_id(record.request_id, c.payer_request_id),
                        kind=RECOMPUTE, tenant_id=c.payer.tenant_id, tenant=c.payer.tenant, key_id=c.payer.key_id,
                        tier=c.payer.tier, ended_at_us=to_us(record.ended_at), recompute_us=c.recompute_us,
                        caused_by=c.payer_request_id)
            for c in usage.recompute_charges]
        self._spool(records + self._platform_records())
        self._count(records)

    def _platform_records(self) -> list[UsageRecord]:
        """Overhead accrued and adapter loads made since the last call."""
        now = to_us(self.gw.wall_clock())
        out = [UsageRecord(request_id=f"adapter-load/{load.load_id}", kind=ADAPTER_LOAD, tenant_id="", tenant="",
                           tier="", ended_at_us=now, adapter=load.adapter_key[0], adapter_version=load.adapter_key[1],
                           adapter_load_us=load.load_us)
               for load in self.meter.take_adapter_loads()]
        overhead_us = self.meter.take_overhead_us()
        if overhead_us:
            o = PLATFORM_OVERHEAD
            out.append(UsageRecord(request_id=f"overhead/{uuid.uuid4().hex}", kind=OVERHEAD, tenant_id=o.tenant_id,
                                   tenant=o.tenant, tier=o.tier, ended_at_us=now, gpu_us=overhead_us))
        return out

    def _spool(self, records: list[UsageRecord]) -> None:
        if records:
            self.spool.append(records)
            self.flusher.wake()

    def count_platform(self, records: list[UsageRecord]) -> None:
        """The flusher's `on_moved`: adapter loads and overhead reach the
        metrics once in the ledger, where an adapter load learns whom it is
        billed to; requests and recompute were counted when settled. So
        loragw:tenant_gpu_seconds_total sums to what the ledger charges."""
        self._count([r for r in records if r.kind in (ADAPTER_LOAD, OVERHEAD)])

    def _count(self, records: list[UsageRecord]) -> None:
        count_usage = getattr(getattr(self.gw, "metrics", None), "count_usage", None)
        if count_usage is None:
            return
        for r in records:
            count_usage(tenant=r.tenant, gpu_us=r.charged_us, prompt_tokens=r.prompt_tokens,
                                completion_tokens=r.completion_tokens)


def recompute_record_id(victim_id: str, payer_request_id: str | None) -> str:
    """`<victim>/recompute/<payer or platform>`; when that would not fit the
    ledger's key (long client X-Request-Ids), a digest of it: a record the
    database refuses would stall the spool behind it."""
    readable = f"{victim_id}/recompute/{payer_request_id or 'platform'}"
    if len(readable) <= MAX_RECORD_ID:
        return readable
    return f"recompute/{hashlib.sha256(readable.encode()).hexdigest()}"


def _request_record(record: RequestRecord, usage: MeteredUsage) -> UsageRecord:
    return UsageRecord(
        request_id=record.request_id, kind=REQUEST, tenant_id=record.tenant_id, tenant=record.tenant,
        key_id=record.key_id, tier=record.tier.value, adapter=record.adapter, adapter_version=record.adapter_version,
        prompt_tokens=record.prompt_tokens, cached_prompt_tokens=record.cached_prompt_tokens,
        completion_tokens=record.completion_tokens, gpu_us=usage.gpu_us,
        queue_us=seconds_to_us(record.queue_time_s), ttft_us=seconds_to_us(record.ttft_s),
        e2e_us=seconds_to_us(record.e2e_s), finish_reason=record.finish_reason,
        started_at_us=to_us(record.started_at), ended_at_us=to_us(record.ended_at))


def adapter_owner_resolver(store, owners: AdapterOwners, registry: Callable[[], object | None]):
    """For the flusher: adapter-load records get their owner tenant from the
    adapter's grant, which is by name, so only while the loaded version is
    still stored: the owner of a name changes only once all its versions
    are deleted. Once the version is gone, the owner `owners` saw using it
    pays, if any; else the grant's (overhead when none is left). A platform
    adapter's loads are overhead. `registry` returns the adapter registry,
    None where there is none."""

    async def resolve(records: list[UsageRecord]) -> list[UsageRecord]:
        out = []
        for r in records:
            if r.kind == ADAPTER_LOAD and not r.tenant_id:
                seen = owners.get(r.adapter, r.adapter_version)
                # A request was seen, so the engine and its registry are up.
                if seen is None or await asyncio.to_thread(_stored, registry(), r.adapter, r.adapter_version):
                    owner = await _owner(store, r.adapter)
                else:
                    owner = seen
                r = UsageRecord.from_dict({**r.to_dict(), "tenant_id": owner.tenant_id, "tenant": owner.tenant,
                                           "tier": owner.tier})
            out.append(r)
        return out

    return resolve


def _stored(registry, adapter: str, version: int | None) -> bool:
    """Whether the version is still stored; True where there is no registry
    to ask, or it cannot answer (then the grant decides, as it did before)."""
    if registry is None:
        return True
    try:
        registry.resolve(f"{adapter}@{version}")
    except AdapterError:
        return False
    except Exception:  # noqa: BLE001 - an unreadable registry must not stall every tenant's records
        # (A version deleted between listing its folder and reading its
        # manifest, an I/O error, a damaged manifest.)
        log.warning("usage spool: could not tell whether adapter %s@%s is stored; its grant decides",
                    adapter, version, exc_info=True)
    return True


async def _owner(store, adapter: str) -> Account:
    try:
        grant = await store.get_adapter_grant(adapter)
        if grant.owner is None:
            return PLATFORM_OVERHEAD
        tenant = await store.get_tenant(grant.owner)
    except NotFound:
        return PLATFORM_OVERHEAD
    return _account(tenant)


def _account(tenant, key_id: str | None = None) -> Account:
    return Account(tenant.id, tenant.name, key_id, tenant.tier.value)


def build_usage_observer(gw, *, spool_path, ledger, settle_timeout_s: float = 1.0) -> UsageObserver:
    """The meter on the engine's usage sink, the spool, its flusher, and the
    observer on the gateway (also started and stopped with the app)."""
    meter = Meter()
    gw.engine.add_usage_sink(meter.on_step)
    spool = Spool(spool_path)
    owners = AdapterOwners()
    flusher = SpoolFlusher(spool, ledger, resolve=adapter_owner_resolver(gw.store, owners, lambda: gw.registry))
    observer = UsageObserver(gw, meter, spool, flusher, owners=owners, settle_timeout_s=settle_timeout_s)
    flusher.on_moved = observer.count_platform
    gw.observers.append(observer)
    gw.background.append(observer)
    return observer
