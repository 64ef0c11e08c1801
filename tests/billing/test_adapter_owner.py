"""Who pays for an adapter load, decided when its record is flushed
(gateway/metering.py `adapter_owner_resolver`): the grant while the loaded
version is stored; once it is deleted, the owner seen using that version,
so neither a deleted grant nor a later owner of the name decides."""

from __future__ import annotations

import pytest

from adapters.errors import AdapterNotFound
from billing.meter import PLATFORM_OVERHEAD, Account
from billing.records import ADAPTER_LOAD, UsageRecord
from gateway.metering import AdapterOwners, adapter_owner_resolver
from gateway.store.base import NotFound
from gateway.tenancy import AdapterGrant, Tenant, Tier

GOLD = Tenant(id="id-gold", name="gold", tier=Tier.PREMIUM)
SILVER = Tenant(id="id-silver", name="silver", tier=Tier.STANDARD)


def account(tenant: Tenant) -> Account:
    return Account(tenant.id, tenant.name, None, tenant.tier.value)


class Store:
    def __init__(self, grants: dict[str, str | None], tenants=(GOLD, SILVER)):
        self.grants, self.tenants = grants, {t.name: t for t in tenants}

    async def get_adapter_grant(self, name: str) -> AdapterGrant:
        if name not in self.grants:
            raise NotFound(f"no grant {name}")
        return AdapterGrant(name=name, owner=self.grants[name], shared=False)

    async def get_tenant(self, name: str) -> Tenant:
        if name not in self.tenants:
            raise NotFound(f"no tenant {name}")
        return self.tenants[name]


class Registry:
    def __init__(self, stored: set[str], error: Exception | None = None):
        self.stored, self.error = stored, error

    def resolve(self, ref: str):
        if self.error is not None:
            raise self.error
        if ref not in self.stored:
            raise AdapterNotFound(f"no adapter {ref}")
        return ref


def load(adapter: str, version: int) -> UsageRecord:
    return UsageRecord(request_id=f"adapter-load/{adapter}-{version}", kind=ADAPTER_LOAD, tenant_id="", tenant="",
                       tier="", ended_at_us=1, adapter=adapter, adapter_version=version, adapter_load_us=100)


async def payer(store, registry, *, seen: Tenant | None, version: int = 1) -> Account:
    owners = AdapterOwners()
    if seen is not None:
        owners.saw("lora", version, account(seen))
    [record] = await adapter_owner_resolver(store, owners, lambda: registry)([load("lora", version)])
    return Account(record.tenant_id, record.tenant, None, record.tier)


@pytest.mark.anyio
async def test_a_stored_version_is_billed_to_its_grants_owner():
    assert await payer(Store({"lora": "gold"}), Registry({"lora@1"}), seen=None) == account(GOLD)
    assert await payer(Store({"lora": "gold"}), Registry({"lora@1"}), seen=GOLD) == account(GOLD)
    assert await payer(Store({"lora": None}), Registry({"lora@1"}), seen=None) == PLATFORM_OVERHEAD


@pytest.mark.anyio
async def test_a_deleted_version_is_billed_to_the_owner_seen_using_it():
    # The grant gone with the adapter; the tenant gone too; the name uploaded again by silver.
    for store in (Store({}), Store({}, tenants=()), Store({"lora": "silver"})):
        assert await payer(store, Registry({"lora@2"}), seen=GOLD) == account(GOLD)
    # Only the deleted version: version 2 is stored, and its grant decides it.
    assert await payer(Store({"lora": "gold"}), Registry({"lora@2"}), seen=GOLD, version=2) == account(GOLD)


@pytest.mark.anyio
async def test_a_deleted_version_nobody_was_seen_owning_falls_back_to_the_grant():
    assert await payer(Store({}), Registry(set()), seen=None) == PLATFORM_OVERHEAD
    assert await payer(Store({"lora": "gold"}), Registry({"lora@2"}), seen=None) == account(GOLD)


@pytest.mark.anyio
async def test_a_registry_that_cannot_answer_leaves_the_grant_to_decide(caplog):
    # A version deleted between listing its folder and reading its manifest,
    # an unreadable data directory: the flush goes on, as it did before.
    for error in (FileNotFoundError("v1.json"), PermissionError("names/lora"), ValueError("bad manifest")):
        registry = Registry({"lora@1"}, error=error)
        assert await payer(Store({"lora": "gold"}), registry, seen=SILVER) == account(GOLD)
        assert await payer(Store({}), registry, seen=GOLD) == PLATFORM_OVERHEAD
    assert "could not tell whether adapter lora@1 is stored" in caplog.text
