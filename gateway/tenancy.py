"""Tenants, their limits and the principal an API key resolves to.

Plain values shared by auth, admission, the OpenAI routes and the admin API.
The database rows that hold them live in `gateway.store`; nothing here
touches a session.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from engine.request import Tier

__all__ = ["Tier", "TenantLimits", "Tenant", "Principal", "ApiKeyInfo", "IssuedKey", "AdapterGrant"]


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant limits; None means unlimited."""

    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass(frozen=True)
class Tenant:
    id: str  # stable opaque id (uuid hex); the cache salt and the ledger use it
    name: str  # unique, URL-safe; the admin API addresses tenants by name
    tier: Tier
    limits: TenantLimits = field(default_factory=TenantLimits)
    created_at: dt.datetime | None = None


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant behind a valid, unexpired, unrevoked key."""

    tenant: Tenant
    key_id: str
    # The key's own expiry, so a cached principal never outlives its key.
    key_expires_at: dt.datetime | None = None

    @property
    def cache_salt(self) -> str:
        # KV blocks are shared only inside a tenant, so no tenant can time
        # another's cached prefix. Derived from the id, never from the client.
        return f"tenant:{self.tenant.id}"


@dataclass(frozen=True)
class ApiKeyInfo:
    """What may be shown about a key after it was issued: never the secret."""

    id: str
    tenant: str  # tenant name
    prefix: str  # the first characters of the secret, to recognise it
    name: str | None
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None


@dataclass(frozen=True)
class IssuedKey:
    """A new key: `secret` is returned once and never stored."""

    info: ApiKeyInfo
    secret: str


@dataclass(frozen=True)
class AdapterGrant:
    """Who may use an adapter name: its owner tenant, or everyone if shared."""

    name: str
    owner: str | None  # tenant name; None for a platform adapter
    shared: bool
