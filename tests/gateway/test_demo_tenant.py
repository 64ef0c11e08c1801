"""The demo tenant: only on the embedded SQLite database or when asked for,
with modest limits, and its key never in a log record."""

from __future__ import annotations

import datetime as dt
import io
import logging

from gateway.config import GatewayConfig
from gateway.demo_tenant import DEMO_LIMITS, announce_demo_key, ensure_demo_tenant
from gateway.store import schema
from gateway.tenancy import TenantLimits
from tests.gateway.live import run_with_store

NOW = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


def _ensure_twice(config: GatewayConfig, url: str):
    async def work(store):
        first = await ensure_demo_tenant(config, store, NOW)
        second = await ensure_demo_tenant(config, store, NOW)
        principal = await store.authenticate(first.secret, now=NOW) if first else None
        return first, second, principal, await store.list_tenants()

    return run_with_store(url, work)


def test_demo_tenant_is_not_created_on_an_explicit_empty_database(db_url):
    """Defect 9: an empty production database (PostgreSQL, or any --db)
    got an unlimited `demo` tenant nobody asked for."""
    first, second, _, tenants = _ensure_twice(GatewayConfig(db_url=db_url), db_url)
    assert first is None and second is None and tenants == []


def test_demo_tenant_flag_creates_it_on_an_explicit_empty_database(db_url):
    first, second, principal, tenants = _ensure_twice(GatewayConfig(db_url=db_url, demo_tenant=True), db_url)
    assert first.secret.startswith("lgw-") and second is None  # only on an empty database
    assert principal.tenant.name == "demo" and [t.name for t in tenants] == ["demo"]
    assert principal.tenant.limits == DEMO_LIMITS


def test_demo_tenant_on_the_embedded_default_has_limits(tmp_path):
    config = GatewayConfig(data_dir=tmp_path / "data")  # no --db: SQLite in the data directory
    url = config.resolved_db_url()
    schema.upgrade(url)
    first, second, principal, _ = _ensure_twice(config, url)
    assert first is not None and second is None
    limits = principal.tenant.limits
    assert limits != TenantLimits()  # not unlimited
    assert 0 < limits.max_concurrent <= 8 and 0 < limits.requests_per_minute <= 120
    assert 0 < limits.tokens_per_minute <= 100_000


def test_demo_key_is_not_in_log_records(tmp_path, caplog):
    """The key is shown on the terminal, never handed to `logging` (whose
    handlers ship records to aggregators)."""
    config = GatewayConfig(data_dir=tmp_path / "data")
    url = config.resolved_db_url()
    schema.upgrade(url)
    out = io.StringIO()
    with caplog.at_level(logging.DEBUG):
        issued = run_with_store(url, lambda store: ensure_demo_tenant(config, store, NOW))
        announce_demo_key(issued, out)
    assert issued.secret in out.getvalue()
    logged = [record.getMessage() for record in caplog.records]
    assert not any(issued.secret in message for message in logged)
