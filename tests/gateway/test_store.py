"""SqlStore on SQLite and PostgreSQL: tenants, keys, auth and adapter grants."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select

from gateway import keys
from gateway.store.base import Conflict, NotFound
from gateway.store.models import ApiKeyRow
from gateway.store.sql import SqlStore
from gateway.tenancy import TenantLimits, Tier

pytestmark = pytest.mark.anyio

NOW = dt.datetime(2025, 6, 1, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
async def store(db_url):
    store = SqlStore.from_url(db_url)
    yield store
    await store.close()


async def test_tenant_lifecycle(store):
    acme = await store.create_tenant("acme", Tier.PREMIUM, TenantLimits(max_concurrent=4))
    await store.create_tenant("beta", Tier.STANDARD, TenantLimits())
    assert len(acme.id) == 32 and acme.tier is Tier.PREMIUM
    assert acme.created_at.tzinfo is not None
    assert await store.get_tenant("acme") == acme
    assert [t.name for t in await store.list_tenants()] == ["acme", "beta"]

    updated = await store.update_tenant("acme", tier=Tier.STANDARD)
    assert updated.tier is Tier.STANDARD and updated.limits == TenantLimits(max_concurrent=4)
    limits = TenantLimits(requests_per_minute=60, tokens_per_minute=1000)
    assert (await store.update_tenant("acme", limits=limits)).limits == limits
    assert (await store.get_tenant("acme")).limits == limits

    with pytest.raises(Conflict) as info:
        await store.create_tenant("acme", Tier.STANDARD, TenantLimits())
    assert info.value.param == "name"
    await store.delete_tenant("acme")
    for missing in (store.get_tenant("acme"), store.update_tenant("acme", tier=Tier.PREMIUM),
                    store.delete_tenant("acme"), store.list_keys("acme")):
        with pytest.raises(NotFound):
            await missing
    assert [t.name for t in await store.list_tenants()] == ["beta"]


async def test_key_is_shown_once_and_stored_only_as_a_hash(store, db_url):
    await store.create_tenant("acme", Tier.STANDARD, TenantLimits())
    issued = await store.create_key("acme", name="ci", now=NOW)
    assert issued.secret.startswith(keys.KEY_PREFIX) and len(issued.secret) > 40
    assert issued.info.prefix == issued.secret[:keys.PREFIX_CHARS]
    assert issued.info.tenant == "acme" and issued.info.name == "ci" and issued.info.created_at == NOW
    assert await store.list_keys("acme") == [issued.info]

    async with store.engine.connect() as conn:
        (row,) = (await conn.execute(select(ApiKeyRow.__table__))).all()
    assert issued.secret not in [str(value) for value in row]
    assert row.key_hash == keys.hash_secret(issued.secret)


async def test_authenticate_live_wrong_expired_and_revoked_keys(store):
    tenant = await store.create_tenant("acme", Tier.PREMIUM, TenantLimits())
    live = await store.create_key("acme", now=NOW)
    expiring = await store.create_key("acme", expires_at=NOW + dt.timedelta(hours=1), now=NOW)
    revoked = await store.create_key("acme", now=NOW)

    principal = await store.authenticate(live.secret, now=NOW)
    assert principal.tenant == tenant and principal.key_id == live.info.id
    assert principal.cache_salt == f"tenant:{tenant.id}"
    assert await store.authenticate(live.secret + "x", now=NOW) is None
    assert await store.authenticate("", now=NOW) is None
    assert await store.authenticate("lgw-" + "A" * 43, now=NOW) is None

    assert await store.authenticate(expiring.secret, now=NOW + dt.timedelta(minutes=59)) is not None
    assert await store.authenticate(expiring.secret, now=NOW + dt.timedelta(hours=1)) is None
    assert await store.authenticate(expiring.secret, now=NOW + dt.timedelta(days=1)) is None

    info = await store.revoke_key(revoked.info.id, now=NOW + dt.timedelta(minutes=5))
    assert info.revoked_at == NOW + dt.timedelta(minutes=5)
    again = await store.revoke_key(revoked.info.id, now=NOW + dt.timedelta(minutes=9))
    assert again.revoked_at == info.revoked_at  # the first revocation stands
    assert await store.authenticate(revoked.secret, now=NOW) is None
    assert await store.authenticate(live.secret, now=NOW) is not None
    with pytest.raises(NotFound):
        await store.revoke_key("no-such-key", now=NOW)


async def test_authenticate_compares_hashes_in_constant_time(store, monkeypatch):
    await store.create_tenant("acme", Tier.STANDARD, TenantLimits())
    issued = await store.create_key("acme", now=NOW)
    calls = []
    real = keys.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keys.hmac, "compare_digest", spy)
    assert await store.authenticate(issued.secret, now=NOW) is not None
    expected = keys.hash_secret(issued.secret).encode()
    assert calls == [(expected, expected)]


async def test_deleting_a_tenant_deletes_its_keys_and_grants(store):
    await store.create_tenant("acme", Tier.STANDARD, TenantLimits())
    await store.create_tenant("beta", Tier.STANDARD, TenantLimits())
    acme_key = await store.create_key("acme", now=NOW)
    beta_key = await store.create_key("beta", now=NOW)
    await store.grant_adapter("acme-bot", owner="acme", shared=False)
    await store.grant_adapter("beta-bot", owner="beta", shared=True)

    await store.delete_tenant("acme")
    assert await store.authenticate(acme_key.secret, now=NOW) is None
    with pytest.raises(NotFound):
        await store.get_adapter_grant("acme-bot")
    with pytest.raises(NotFound):
        await store.revoke_key(acme_key.info.id, now=NOW)
    assert (await store.authenticate(beta_key.secret, now=NOW)).tenant.name == "beta"
    assert [g.name for g in await store.list_adapter_grants()] == ["beta-bot"]
    # A tenant of the same name later is a new tenant: nothing carries over.
    await store.create_tenant("acme", Tier.STANDARD, TenantLimits())
    assert await store.list_keys("acme") == []


async def test_adapter_grants(store):
    await store.create_tenant("acme", Tier.STANDARD, TenantLimits())
    await store.create_tenant("beta", Tier.STANDARD, TenantLimits())
    await store.grant_adapter("acme-bot", owner="acme", shared=False)
    await store.grant_adapter("common", owner=None, shared=True)
    await store.grant_adapter("beta-bot", owner="beta", shared=False)
    await store.grant_adapter("hidden", owner=None, shared=False)

    assert (await store.get_adapter_grant("acme-bot")).owner == "acme"
    assert [g.name for g in await store.list_adapter_grants()] == ["acme-bot", "beta-bot", "common", "hidden"]
    assert [g.name for g in await store.list_adapter_grants(visible_to="acme")] == ["acme-bot", "common"]
    assert [g.name for g in await store.list_adapter_grants(visible_to="beta")] == ["beta-bot", "common"]

    replaced = await store.grant_adapter("beta-bot", owner="beta", shared=True)  # replaces the grant
    assert replaced.shared and await store.get_adapter_grant("beta-bot") == replaced
    assert "beta-bot" in [g.name for g in await store.list_adapter_grants(visible_to="acme")]

    with pytest.raises(NotFound):
        await store.grant_adapter("x", owner="ghost", shared=False)
    with pytest.raises(NotFound):
        await store.list_adapter_grants(visible_to="ghost")
    await store.delete_adapter_grant("common")
    with pytest.raises(NotFound):
        await store.get_adapter_grant("common")
    with pytest.raises(NotFound):
        await store.delete_adapter_grant("common")


async def test_migrations_match_the_models(db_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    import migrations
    from gateway.store import schema

    store = SqlStore.from_url(db_url)
    try:
        assert await migrations.current_revision(store.engine) == migrations.head_revision()
        async with store.engine.connect() as conn:
            diff = await conn.run_sync(lambda c: compare_metadata(
                MigrationContext.configure(c, opts={"compare_type": True}), schema.target_metadata()))
        assert diff == []
        await migrations.upgrade_engine(store.engine)  # at head already: a no-op
    finally:
        await store.close()


async def test_sqlite_database_is_created_owner_only(tmp_path):
    import os
    import stat

    from gateway.store import schema

    old_umask = os.umask(0o022)  # the usual default: new files 0644, world-readable
    try:
        url = f"sqlite+aiosqlite:///{tmp_path / 'loragw.db'}"
        await schema.upgrade_async(url)
        store = SqlStore.from_url(url)
        await store.create_tenant("acme", Tier.STANDARD, TenantLimits())
        await store.close()
    finally:
        os.umask(old_umask)
    files = [p for p in tmp_path.iterdir() if p.name.startswith("loragw.db")]
    assert files and {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o600 for p in files}
