"""A database that cannot be reached is `StoreUnavailable` from the store
and a 503 with Retry-After from the API, quickly; other database errors
keep their meaning."""

from __future__ import annotations

import datetime as dt
import socket
import sqlite3
import time

import asyncpg
import pytest
from sqlalchemy import exc as sa_exc

from gateway.errors import to_api_error
from gateway.store import sql
from gateway.store.base import Conflict, StoreUnavailable
from gateway.store.sql import SqlStore
from gateway.tenancy import TenantLimits, Tier

pytestmark = pytest.mark.anyio
NOW = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_db_down_refused_postgres_is_store_unavailable_at_once():
    store = SqlStore.from_url(f"postgresql+asyncpg://postgres@127.0.0.1:{_closed_port()}/loragw")
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.authenticate("lgw-anything", now=NOW)
        with pytest.raises(StoreUnavailable):
            await store.list_tenants()
        assert time.monotonic() - started < 5
    finally:
        await store.close()


async def test_db_down_silent_postgres_fails_within_the_connect_timeout(monkeypatch):
    """A peer that accepts TCP but never answers (a hung server, a black
    hole): asyncpg's default would wait 60 s."""
    monkeypatch.setattr(sql, "CONNECT_TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nobody ever reads
        port = silent.getsockname()[1]
        store = SqlStore.from_url(f"postgresql+asyncpg://postgres@127.0.0.1:{port}/loragw")
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.authenticate("lgw-anything", now=NOW)
            assert time.monotonic() - started < 10
        finally:
            await store.close()


@pytest.fixture
def sqlite_path(tmp_path):
    from gateway.store import schema

    path = tmp_path / "loragw.db"
    schema.upgrade(f"sqlite+aiosqlite:///{path}")
    return path


async def test_db_down_locked_sqlite_is_store_unavailable(sqlite_path):
    path = sqlite_path
    store = SqlStore.from_url(f"sqlite+aiosqlite:///{path}?timeout=0.1")
    lock = sqlite3.connect(path, isolation_level=None)
    try:
        await store.create_tenant("acme", Tier.STANDARD, TenantLimits())
        lock.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreUnavailable):
            await store.get_tenant("acme")
        lock.execute("ROLLBACK")
        assert (await store.get_tenant("acme")).name == "acme"
        with pytest.raises(Conflict):  # an integrity error is no outage
            await store.create_tenant("acme", Tier.STANDARD, TenantLimits())
    finally:
        lock.close()
        await store.close()


def _dbapi(cls, **kwargs):
    return cls("SELECT 1", {}, Exception("driver"), **kwargs)


@pytest.mark.parametrize("exc", [
    StoreUnavailable("down"),
    ConnectionRefusedError(111, "Connect call failed"),
    TimeoutError(),
    _dbapi(sa_exc.OperationalError),
    _dbapi(sa_exc.InterfaceError),
    _dbapi(sa_exc.DBAPIError, connection_invalidated=True),
    sa_exc.TimeoutError("QueuePool limit of size 5 overflow 10 reached"),
    asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
    asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
], ids=lambda e: type(e).__name__)
def test_db_down_errors_are_503_with_retry_after(exc):
    error = to_api_error(exc)
    assert (error.status, error.code) == (503, "database_unavailable")
    assert int(error.headers["Retry-After"]) >= 1


@pytest.mark.parametrize("exc", [_dbapi(sa_exc.IntegrityError), _dbapi(sa_exc.ProgrammingError),
                                 FileNotFoundError("adapter.safetensors")], ids=lambda e: type(e).__name__)
def test_db_down_other_errors_are_not_taken_for_an_outage(exc):
    assert to_api_error(exc).status == 500
