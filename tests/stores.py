"""The external stores the suite runs against when it can: PostgreSQL (the
production database) and Redis (tenant limits shared by replicas).

Each is named by a variable: $LORAGW_TEST_POSTGRES_URL and
$LORAGW_TEST_REDIS_URL. When one is unset, the session looks for the
server on localhost (PostgreSQL on 5432 as user postgres, Redis on 6379):
PostgreSQL gets a fresh database, dropped when the session ends, and Redis
a logical database of its own ($LORAGW_TEST_REDIS_DB, default 15). Tests
that need a store nobody runs skip with a reason starting "PostgreSQL:" or
"Redis:", and the end of the session lists them.
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import uuid

POSTGRES_ENV = "LORAGW_TEST_POSTGRES_URL"
REDIS_ENV = "LORAGW_TEST_REDIS_URL"
REDIS_DB_ENV = "LORAGW_TEST_REDIS_DB"
STORES = ("PostgreSQL", "Redis")
_LOCAL_PG = "postgresql://postgres@127.0.0.1:5432"
_CONNECT_TIMEOUT_S = 2.0

# What this session found, for the summary: store -> how it is used.
_found: dict[str, str] = {}
_created_database: list[str] = []


def skip_reason(store: str, why: str) -> str:
    """A skip reason the session summary groups by store."""
    return f"{store}: {why}"


def _redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


async def _admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(f"{_LOCAL_PG}/postgres", timeout=_CONNECT_TIMEOUT_S)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def _find_postgres() -> None:
    if os.environ.get(POSTGRES_ENV):
        _found["PostgreSQL"] = f"${POSTGRES_ENV}"
        return
    name = f"loragw_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        asyncio.run(_admin(f"CREATE DATABASE {name}"))
    except Exception:  # noqa: BLE001 - any failure means: no PostgreSQL for this session
        _found["PostgreSQL"] = ""
        return
    _created_database.append(name)
    os.environ[POSTGRES_ENV] = f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    _found["PostgreSQL"] = f"database {name} on 127.0.0.1:5432 (dropped at the end)"


def _find_redis() -> None:
    if os.environ.get(REDIS_ENV):
        _found["Redis"] = f"${REDIS_ENV}"
        return
    if not _redis_answers("127.0.0.1", 6379):
        _found["Redis"] = ""
        return
    db = int(os.environ.get(REDIS_DB_ENV, "15"))
    os.environ[REDIS_ENV] = f"redis://127.0.0.1:6379/{db}"
    _found["Redis"] = f"logical database {db} on 127.0.0.1:6379"


def unavailable(store: str) -> str:
    """Why `store` is not available to this session's tests."""
    env = POSTGRES_ENV if store == "PostgreSQL" else REDIS_ENV
    where = "127.0.0.1:5432" if store == "PostgreSQL" else "127.0.0.1:6379"
    return skip_reason(store, f"${env} is not set and nothing answers on {where}")


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller found the stores
        return
    _find_postgres()
    _find_redis()


def pytest_unconfigure(config) -> None:
    for name in _created_database:
        try:
            asyncio.run(_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        except Exception as exc:  # noqa: BLE001 - the session's result stands; say what is left behind
            print(f"note: could not drop the test database {name}: {exc}")
    _created_database.clear()


def pytest_terminal_summary(terminalreporter) -> None:
    skipped = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith(tuple(f"{store}:" for store in STORES)):
            skipped[reason] += 1
    if not _found and not skipped:
        return
    terminalreporter.section("external stores")
    for store in STORES:
        if store in _found:
            terminalreporter.line(f"{store}: {_found[store] or 'not available'}")
    for reason, count in sorted(skipped.items()):
        terminalreporter.line(f"skipped {count} test(s): {reason}")
