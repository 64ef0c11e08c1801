"""`SqlStore`: the `Store` contract over SQLAlchemy's async engine.

SQLite (aiosqlite) by default, PostgreSQL (asyncpg) in production; the same
code and the same alembic schema serve both. Each method runs in one
transaction of its own.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

from sqlalchemy import delete, event, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from billing.sqlite_file import create_private_sqlite_file
from gateway import keys
from gateway.store.base import Conflict, NotFound, Store
from gateway.store.outage import guard_unavailable
from gateway.store.models import AdapterGrantRow, ApiKeyRow, TenantRow
from gateway.tenancy import AdapterGrant, ApiKeyInfo, IssuedKey, Principal, Tenant, TenantLimits, Tier


# A dead database must fail a request in seconds, not hang it: asyncpg
# waits 60 s to connect by default and SQLAlchemy's pool 30 s for a free
# connection. The command timeout bounds a query on a connection whose peer
# went silent (no RST), and stays generous for usage exports.
CONNECT_TIMEOUT_S = 5.0
POOL_TIMEOUT_S = 5.0
COMMAND_TIMEOUT_S = 60.0


def create_engine(url: str, **kwargs) -> AsyncEngine:
    """An async engine for `url`; on SQLite with foreign keys enforced.
    Connections are checked before use (`pool_pre_ping`), so those a
    database restart killed are replaced instead of failing a request."""
    kwargs.setdefault("pool_pre_ping", True)
    if url.startswith("postgresql"):
        kwargs.setdefault("pool_timeout", POOL_TIMEOUT_S)
        kwargs["connect_args"] = {"timeout": CONNECT_TIMEOUT_S, "command_timeout": COMMAND_TIMEOUT_S,
                                  **kwargs.get("connect_args", {})}
    engine = create_async_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        if engine.url.database not in (None, "", ":memory:") and not engine.url.database.startswith("file:"):
            create_private_sqlite_file(Path(engine.url.database))  # before SQLite creates it 0644

        @event.listens_for(engine.sync_engine, "connect")
        def _foreign_keys_on(dbapi_connection, _record):
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.close()
    return engine


@guard_unavailable
class SqlStore(Store):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def from_url(cls, url: str, **engine_kwargs) -> SqlStore:
        return cls(create_engine(url, **engine_kwargs))

    async def close(self) -> None:
        await self.engine.dispose()

    # ---- tenants ----

    async def create_tenant(self, name: str, tier: Tier, limits: TenantLimits,
                            *, now: dt.datetime | None = None) -> Tenant:
        row = TenantRow(id=uuid.uuid4().hex, name=name, tier=Tier(tier).value,
                        created_at=now or dt.datetime.now(dt.UTC))
        _set_limits(row, limits)
        try:
            async with self._sessions.begin() as s:
                s.add(row)
        except IntegrityError:
            raise Conflict(f"tenant {name!r} already exists", param="name") from None
        return _tenant(row)

    async def get_tenant(self, name: str) -> Tenant:
        async with self._sessions() as s:
            return _tenant(await _tenant_row(s, name))

    async def list_tenants(self) -> list[Tenant]:
        async with self._sessions() as s:
            rows = await s.scalars(select(TenantRow).order_by(TenantRow.name))
            return [_tenant(r) for r in rows]

    async def update_tenant(self, name: str, *, tier: Tier | None = None,
                            limits: TenantLimits | None = None) -> Tenant:
        async with self._sessions.begin() as s:
            row = await _tenant_row(s, name)
            if tier is not None:
                row.tier = Tier(tier).value
            if limits is not None:
                _set_limits(row, limits)
        return _tenant(row)

    async def delete_tenant(self, name: str) -> None:
        async with self._sessions.begin() as s:
            row = await _tenant_row(s, name)
            # The foreign keys cascade too; deleting explicitly keeps this
            # true on a SQLite connection opened without PRAGMA foreign_keys.
            await s.execute(delete(ApiKeyRow).where(ApiKeyRow.tenant_id == row.id))
            await s.execute(delete(AdapterGrantRow).where(AdapterGrantRow.owner_id == row.id))
            await s.delete(row)

    # ---- API keys ----

    async def create_key(self, tenant: str, *, name: str | None = None,
                         expires_at: dt.datetime | None = None, now: dt.datetime) -> IssuedKey:
        new = keys.generate_secret()
        async with self._sessions.begin() as s:
            owner = await _tenant_row(s, tenant)
            row = ApiKeyRow(id=uuid.uuid4().hex, tenant_id=owner.id, key_hash=new.key_hash,
                            prefix=new.prefix, name=name, created_at=now, expires_at=expires_at)
            s.add(row)
        return IssuedKey(info=_key_info(row, owner.name), secret=new.secret)

    async def list_keys(self, tenant: str) -> list[ApiKeyInfo]:
        async with self._sessions() as s:
            owner = await _tenant_row(s, tenant)
            rows = await s.scalars(select(ApiKeyRow).where(ApiKeyRow.tenant_id == owner.id)
                                   .order_by(ApiKeyRow.created_at, ApiKeyRow.id))
            return [_key_info(r, owner.name) for r in rows]

    async def revoke_key(self, key_id: str, *, now: dt.datetime) -> ApiKeyInfo:
        async with self._sessions.begin() as s:
            found = (await s.execute(
                select(ApiKeyRow, TenantRow.name).join(TenantRow, TenantRow.id == ApiKeyRow.tenant_id)
                .where(ApiKeyRow.id == key_id))).first()
            if found is None:
                raise NotFound(f"no API key {key_id!r}", param="key_id")
            row, tenant_name = found
            if row.revoked_at is None:  # revoking twice keeps the first time
                row.revoked_at = now
        return _key_info(row, tenant_name)

    async def authenticate(self, secret: str, *, now: dt.datetime) -> Principal | None:
        presented = keys.hash_secret(secret)
        async with self._sessions() as s:
            found = (await s.execute(
                select(ApiKeyRow, TenantRow).join(TenantRow, TenantRow.id == ApiKeyRow.tenant_id)
                .where(ApiKeyRow.key_hash == presented))).first()
        if found is None:
            return None
        key, tenant = found
        if not keys.hashes_match(key.key_hash, presented):
            return None
        if key.revoked_at is not None or (key.expires_at is not None and key.expires_at <= now):
            return None
        return Principal(tenant=_tenant(tenant), key_id=key.id, key_expires_at=key.expires_at)

    # ---- adapter grants ----

    async def grant_adapter(self, name: str, *, owner: str | None, shared: bool) -> AdapterGrant:
        async with self._sessions.begin() as s:
            owner_id = (await _tenant_row(s, owner)).id if owner is not None else None
            row = await s.get(AdapterGrantRow, name)
            if row is None:
                s.add(AdapterGrantRow(name=name, owner_id=owner_id, shared=shared))
            else:
                row.owner_id, row.shared = owner_id, shared
        return AdapterGrant(name=name, owner=owner, shared=shared)

    async def get_adapter_grant(self, name: str) -> AdapterGrant:
        async with self._sessions() as s:
            found = (await s.execute(_grants().where(AdapterGrantRow.name == name))).first()
        if found is None:
            raise NotFound(f"no grant for adapter {name!r}", param="name")
        return _grant(*found)

    async def list_adapter_grants(self, *, visible_to: str | None = None) -> list[AdapterGrant]:
        query = _grants().order_by(AdapterGrantRow.name)
        async with self._sessions() as s:
            if visible_to is not None:
                tenant_id = (await _tenant_row(s, visible_to)).id
                query = query.where(or_(AdapterGrantRow.shared, AdapterGrantRow.owner_id == tenant_id))
            return [_grant(*found) for found in await s.execute(query)]

    async def delete_adapter_grant(self, name: str) -> None:
        async with self._sessions.begin() as s:
            result = await s.execute(delete(AdapterGrantRow).where(AdapterGrantRow.name == name))
            if result.rowcount == 0:
                raise NotFound(f"no grant for adapter {name!r}", param="name")


async def _tenant_row(s: AsyncSession, name: str) -> TenantRow:
    row = await s.scalar(select(TenantRow).where(TenantRow.name == name))
    if row is None:
        raise NotFound(f"no tenant {name!r}", param="tenant")
    return row


def _set_limits(row: TenantRow, limits: TenantLimits) -> None:
    row.max_concurrent = limits.max_concurrent
    row.requests_per_minute = limits.requests_per_minute
    row.tokens_per_minute = limits.tokens_per_minute


def _tenant(row: TenantRow) -> Tenant:
    limits = TenantLimits(max_concurrent=row.max_concurrent, requests_per_minute=row.requests_per_minute,
                          tokens_per_minute=row.tokens_per_minute)
    return Tenant(id=row.id, name=row.name, tier=Tier(row.tier), limits=limits, created_at=row.created_at)


def _key_info(row: ApiKeyRow, tenant_name: str) -> ApiKeyInfo:
    return ApiKeyInfo(id=row.id, tenant=tenant_name, prefix=row.prefix, name=row.name,
                      created_at=row.created_at, expires_at=row.expires_at, revoked_at=row.revoked_at)


def _grants():
    return select(AdapterGrantRow, TenantRow.name).outerjoin(TenantRow, TenantRow.id == AdapterGrantRow.owner_id)


def _grant(row: AdapterGrantRow, owner: str | None) -> AdapterGrant:
    return AdapterGrant(name=row.name, owner=owner, shared=row.shared)
