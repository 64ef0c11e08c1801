"""The storage contract the gateway's auth, admin API and CLI rely on.

Every method is a coroutine and commits its own transaction. Lookups of
something absent raise `NotFound`; creating something that exists raises
`Conflict`; a database that cannot be reached raises `StoreUnavailable`. Time is passed in (`now`) so that expiry is testable without
sleeping. Tenants are addressed by name in every method.
"""

from __future__ import annotations

import abc
import datetime as dt

from gateway.tenancy import AdapterGrant, ApiKeyInfo, IssuedKey, Principal, Tenant, TenantLimits, Tier


class StoreError(Exception):
    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class NotFound(StoreError):
    pass


class Conflict(StoreError):
    pass


class StoreUnavailable(StoreError):
    """The database cannot be reached or did not answer in time (refused or
    dropped connections, timeouts, an exhausted pool). Transient: the
    request may be retried, so the API answers 503 with Retry-After."""


class Store(abc.ABC):
    # ---- tenants ----
    @abc.abstractmethod
    async def create_tenant(self, name: str, tier: Tier, limits: TenantLimits) -> Tenant: ...

    @abc.abstractmethod
    async def get_tenant(self, name: str) -> Tenant: ...

    @abc.abstractmethod
    async def list_tenants(self) -> list[Tenant]: ...

    @abc.abstractmethod
    async def update_tenant(self, name: str, *, tier: Tier | None = None,
                            limits: TenantLimits | None = None) -> Tenant:
        """Only the given fields change; `limits` replaces all three limits."""

    @abc.abstractmethod
    async def delete_tenant(self, name: str) -> None:
        """Also deletes its keys and its adapter grants."""

    # ---- API keys ----
    @abc.abstractmethod
    async def create_key(self, tenant: str, *, name: str | None = None,
                         expires_at: dt.datetime | None = None, now: dt.datetime) -> IssuedKey: ...

    @abc.abstractmethod
    async def list_keys(self, tenant: str) -> list[ApiKeyInfo]: ...

    @abc.abstractmethod
    async def revoke_key(self, key_id: str, *, now: dt.datetime) -> ApiKeyInfo: ...

    @abc.abstractmethod
    async def authenticate(self, secret: str, *, now: dt.datetime) -> Principal | None:
        """The principal for a live key; None for an unknown, revoked or
        expired one (the caller does not learn which)."""

    # ---- adapter ownership (the weights live in the adapter registry) ----
    @abc.abstractmethod
    async def grant_adapter(self, name: str, *, owner: str | None, shared: bool) -> AdapterGrant:
        """Record who may use adapter `name`; replaces an existing grant."""

    @abc.abstractmethod
    async def get_adapter_grant(self, name: str) -> AdapterGrant: ...

    @abc.abstractmethod
    async def list_adapter_grants(self, *, visible_to: str | None = None) -> list[AdapterGrant]:
        """Every grant, or those the tenant `visible_to` may use (its own
        plus the shared ones)."""

    @abc.abstractmethod
    async def delete_adapter_grant(self, name: str) -> None: ...

    async def close(self) -> None:
        """Release connections."""
