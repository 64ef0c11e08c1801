"""The admin operations, shared by the admin REST API and the `loragw` CLI.

Both front ends parse their input into `gateway.schemas.admin` models, call
one method here and print the model it returns, so a tenant, key or adapter
behaves the same whichever way it was managed. Errors are the store's
`NotFound`/`Conflict`, the registry's `AdapterError` (a bad upload, 400) and
`errors.InvalidRequest`; `gateway.errors` maps them to HTTP and the CLI
prints their message.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

from adapters.errors import AdapterNotFound
from adapters.registry import AdapterManifest, AdapterRegistry, parse_ref, validate_name
from adapters.store import exclusive_lock_async
from gateway.errors import APIError, InvalidRequest
from gateway.schemas.admin import (AdapterOut, AdapterUpload, AdapterVersionOut, Deleted, IssuedKeyOut, KeyCreate,
                                   KeyOut, LimitsOut, TenantCreate, TenantOut, TenantUpdate)
from gateway.store.base import Conflict, NotFound, Store
from gateway.tenancy import AdapterGrant, ApiKeyInfo, Tenant, TenantLimits


class AdminService:
    """`registry` is called when an operation needs the adapter registry, so
    tenant and key operations work before (or without) one."""

    def __init__(self, store: Store, *, registry: Callable[[], AdapterRegistry],
                 now: Callable[[], dt.datetime]):
        self.store = store
        self._registry = registry
        self._now = now

    # ---- tenants ----

    async def create_tenant(self, body: TenantCreate) -> TenantOut:
        limits = TenantLimits(**body.limits.model_dump())
        return _tenant_out(await self.store.create_tenant(body.name, body.tier, limits))

    async def list_tenants(self) -> list[TenantOut]:
        return [_tenant_out(t) for t in await self.store.list_tenants()]

    async def get_tenant(self, name: str) -> TenantOut:
        return _tenant_out(await self.store.get_tenant(name))

    async def update_tenant(self, name: str, body: TenantUpdate) -> TenantOut:
        limits = None
        if body.limits is not None:
            current = (await self.store.get_tenant(name)).limits
            limits = replace(current, **body.limits.model_dump(exclude_unset=True))
        return _tenant_out(await self.store.update_tenant(name, tier=body.tier, limits=limits))

    async def delete_tenant(self, name: str) -> Deleted:
        """Deletes the tenant, its keys, and the adapters it owns."""
        await self.store.get_tenant(name)
        registry, unavailable = None, None
        try:
            registry = self._registry()
        except APIError as exc:  # adapters off, or not loaded yet: no upload can be under way either
            unavailable = exc
        async with adapter_writes(registry):  # an upload for this tenant lands before, or fails after
            owned = [g.name for g in await self.store.list_adapter_grants() if g.owner == name]
            if owned and unavailable is not None:
                raise unavailable  # why its adapters cannot go: before anything has changed
            await self.store.delete_tenant(name)
            for adapter in owned:
                try:
                    await asyncio.to_thread(registry.delete, adapter)
                except AdapterNotFound:
                    pass
        return Deleted(object="tenant", id=name)

    # ---- keys ----

    async def create_key(self, tenant: str, body: KeyCreate) -> IssuedKeyOut:
        now = self._now()
        expires_at = body.expires_at
        if body.expires_in is not None:
            expires_at = now + dt.timedelta(seconds=body.expires_in)
        if expires_at is not None and expires_at <= now:
            raise InvalidRequest("expires_at is in the past", param="expires_at")
        issued = await self.store.create_key(tenant, name=body.name, expires_at=expires_at, now=now)
        return IssuedKeyOut(**self._key_out(issued.info).model_dump(), key=issued.secret)

    async def list_keys(self, tenant: str) -> list[KeyOut]:
        return [self._key_out(k) for k in await self.store.list_keys(tenant)]

    async def revoke_key(self, key_id: str) -> KeyOut:
        return self._key_out(await self.store.revoke_key(key_id, now=self._now()))

    def _key_out(self, key: ApiKeyInfo) -> KeyOut:
        if key.revoked_at is not None:
            status = "revoked"
        elif key.expires_at is not None and key.expires_at <= self._now():
            status = "expired"
        else:
            status = "active"
        return KeyOut(id=key.id, tenant=key.tenant, prefix=key.prefix, name=key.name, status=status,
                      created_at=key.created_at, expires_at=key.expires_at, revoked_at=key.revoked_at)

    # ---- adapters ----

    async def upload_adapter(self, fields: AdapterUpload, config_json: bytes, weights: bytes) -> AdapterOut:
        """Validate and store an uploaded adapter, then record its grant."""
        return await self._store_adapter(fields, lambda registry: registry.put(fields.name, config_json, weights))

    async def import_adapter_dir(self, fields: AdapterUpload, src: Path) -> AdapterOut:
        """The same from a directory written by peft's save_pretrained."""
        return await self._store_adapter(fields, lambda registry: registry.import_dir(fields.name, src))

    async def _store_adapter(self, fields: AdapterUpload,
                             put: Callable[[AdapterRegistry], AdapterManifest]) -> AdapterOut:
        # Shielded: a request cancelled mid-way (a client gone, a forced
        # shutdown) must not stop between the weights and their grant.
        return await asyncio.shield(asyncio.ensure_future(self._store_adapter_whole(fields, put)))

    async def _store_adapter_whole(self, fields: AdapterUpload,
                                   put: Callable[[AdapterRegistry], AdapterManifest]) -> AdapterOut:
        name = validate_name(fields.name)
        registry = self._registry()
        # The owner check, the weights and the grant are one step: two uploads
        # of a new name at once could each pass the check, and the grant
        # written last would give its tenant the other's weights.
        async with adapter_writes(registry):
            if fields.tenant is not None:
                await self.store.get_tenant(fields.tenant)
            current = await self._grant(name)
            before = {m.version for m in await _versions(registry, name)}
            if before and current.owner != fields.tenant:
                owner = f"tenant {current.owner!r}" if current.owner else "the platform"
                raise Conflict(f"adapter {name!r} belongs to {owner}; delete it first to give it another owner",
                               param="tenant")
            manifest = await asyncio.to_thread(put, registry)
            try:
                if fields.tenant is None and not fields.shared:
                    await self._drop_grant(name)  # no row: a platform adapter no tenant may use
                else:
                    await self.store.grant_adapter(name, owner=fields.tenant, shared=fields.shared)
            except BaseException:
                # No grant, no weights: left behind, they would be a platform adapter nobody uploaded.
                if manifest.version not in before:
                    await asyncio.to_thread(registry.delete, name, manifest.version)
                raise
            return await self.get_adapter(name)

    async def list_adapters(self) -> list[AdapterOut]:
        versions: dict[str, list[AdapterManifest]] = defaultdict(list)
        for manifest in await asyncio.to_thread(self._registry().list, all_versions=True):
            versions[manifest.name].append(manifest)
        grants = {g.name: g for g in await self.store.list_adapter_grants()}
        return [_adapter_out(grants.get(name) or _platform(name), found) for name, found in versions.items()]

    async def get_adapter(self, name: str) -> AdapterOut:
        name = validate_name(name)
        found = await _versions(self._registry(), name)
        if not found:
            raise NotFound(f"no adapter {name!r}", param="name")
        return _adapter_out(await self._grant(name), found)

    async def delete_adapter(self, ref: str) -> Deleted:
        """Delete NAME (every version) or NAME@VERSION. Requests already
        running keep their loaded weights; new ones no longer find it."""
        name, version = parse_ref(ref, param="name")
        registry = self._registry()
        async with adapter_writes(registry):
            try:
                await asyncio.to_thread(registry.delete, name, version)
            except AdapterNotFound as exc:
                raise NotFound(exc.message, param="name") from None
            if not await _versions(registry, name):
                await self._drop_grant(name)
        return Deleted(object="adapter", id=ref)

    async def _grant(self, name: str) -> AdapterGrant:
        try:
            return await self.store.get_adapter_grant(name)
        except NotFound:
            return _platform(name)

    async def _drop_grant(self, name: str) -> None:
        try:
            await self.store.delete_adapter_grant(name)
        except NotFound:
            pass


@contextlib.asynccontextmanager
async def adapter_writes(registry: AdapterRegistry | None) -> AsyncIterator[None]:
    """Hold the registry's lock on adapter ownership for the block: one
    upload, adapter deletion or tenant deletion at a time, across this
    process's requests and every process on the same data directory (the
    CLI beside a server). A file lock, not an asyncio one, for the second;
    polled, so the event loop never waits on it. The registry's own lock,
    which `put` and `delete` take inside this one, is another file.
    None: no registry, nothing to hold."""
    if registry is None:
        yield
        return
    async with exclusive_lock_async(registry.root / ".ownership.lock"):
        yield


async def _versions(registry: AdapterRegistry, name: str) -> list[AdapterManifest]:
    """Every live version of `name`, oldest first."""
    every = await asyncio.to_thread(registry.list, all_versions=True)
    return [m for m in every if m.name == name]


def _platform(name: str) -> AdapterGrant:
    return AdapterGrant(name=name, owner=None, shared=False)


def _tenant_out(t: Tenant) -> TenantOut:
    limits = LimitsOut(max_concurrent=t.limits.max_concurrent, requests_per_minute=t.limits.requests_per_minute,
                       tokens_per_minute=t.limits.tokens_per_minute)
    return TenantOut(id=t.id, name=t.name, tier=t.tier, limits=limits, created_at=t.created_at)


def _adapter_out(grant: AdapterGrant, manifests: list[AdapterManifest]) -> AdapterOut:
    versions = [AdapterVersionOut(version=m.version, ref=m.ref, digest=m.digest, rank=m.rank,
                                  target_modules=list(m.target_modules), size_bytes=m.size_bytes,
                                  created_at=m.created_at)
                for m in sorted(manifests, key=lambda m: m.version)]
    return AdapterOut(name=grant.name, owner=grant.owner, shared=grant.shared,
                      latest_version=versions[-1].version, versions=versions)
