"""The `demo` tenant: a first key for a fresh `make serve`, so a new user
can call the gateway at once.

Only where that is what the operator wants: on the embedded SQLite database
(no `--db`), or with `--demo-tenant`. A production database (PostgreSQL, or
any `--db`) never gets a tenant nobody asked for. The demo tenant has modest
limits, so a key that leaked from a terminal cannot take the server, and its
key is written to the terminal only, never through `logging`: log handlers
ship records to aggregators that many people can read.
"""

from __future__ import annotations

import datetime as dt
import sys
from typing import TextIO

from gateway.config import GatewayConfig
from gateway.store.base import Store
from gateway.tenancy import IssuedKey, TenantLimits, Tier

DEMO_TENANT = "demo"
# Enough to try every endpoint by hand and run a small script; not enough
# to starve real tenants of the engine.
DEMO_LIMITS = TenantLimits(max_concurrent=4, requests_per_minute=60, tokens_per_minute=20_000)


async def ensure_demo_tenant(config: GatewayConfig, store: Store, now: dt.datetime) -> IssuedKey | None:
    """The `demo` tenant (standard tier, DEMO_LIMITS) and its first key, if
    the config asks for one and the database has no tenant yet; else None."""
    if not config.creates_demo_tenant or await store.list_tenants():
        return None
    await store.create_tenant(DEMO_TENANT, Tier.STANDARD, DEMO_LIMITS)
    return await store.create_key(DEMO_TENANT, name="demo", now=now)


def announce_demo_key(issued: IssuedKey, out: TextIO | None = None) -> None:
    """Show the key once, on stdout (a terminal under `make serve`)."""
    out = out or sys.stdout
    print(f"created tenant {DEMO_TENANT!r}; its API key (shown once, keep it):\n\n    {issued.secret}\n",
          file=out, flush=True)
